"""Holding requests for a lost FFN rank (`hold_s` > 0), and the launched steps taken back when it is lost.

Each launched step's undo (`afd.engine.recovery.rewind.snapshot`) is kept until its tokens are read. When the
FFN rank is lost, the unread steps are taken back (`afd.engine.recovery.rewind.rewind`) and every request waits,
KV cache intact, while the link re-handshakes; once it is back they go on, and past `hold_s` they fail.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from afd.engine.recovery.rewind import StepUndo, rewind, snapshot
from afd.engine.request import Request

log = logging.getLogger(__name__)


class Hold:
    """The unread steps of one engine and its hold; `hold_s()` reads the engine's hold time, `holding()` counts the
    requests it holds."""

    def __init__(self, hold_s: Callable[[], float], observer, holding: Callable[[], int]):
        self._hold_s, self.observer, self._holding = hold_s, observer, holding
        self.since: float | None = None  # requests are held for the FFN since then
        self.unread: list[StepUndo] = []  # launched steps whose tokens are not read yet, oldest first

    def launched(self, batch: list[Request], step_id: int, prev_tokens: torch.Tensor) -> StepUndo:
        """Before building a step over `batch`: what to restore should it be lost."""
        undo = snapshot(batch, step_id, prev_tokens)
        self.unread.append(undo)
        return undo

    def read(self) -> None:
        """The oldest launched step is read (or failed): never taken back."""
        if self.unread:
            self.unread.pop(0)

    def forget(self, undo: StepUndo) -> None:
        """`undo`'s step ended without a launch to read (failed, or taken back)."""
        if undo in self.unread:
            self.unread.remove(undo)

    def in_flight(self) -> set[Request]:
        """The requests of the unread steps: a step taken back lowers the counts of their controls slots, so a slot
        goes to another request only once none of them holds it."""
        return {row[0] for undo in self.unread for row in undo.rows}

    def taken_back(self, undo: StepUndo) -> bool:
        return undo not in self.unread

    def take_back(self, vocab: int, device: torch.device) -> tuple[int, torch.Tensor] | None:
        """The FFN was lost: the unread steps are taken back ((step count, sampled tokens) to build the next step
        from; None: none were unread), and every request is held from now."""
        back = None
        if self.unread:
            step_id, prev_tokens, _ = rewind(self.unread, vocab, device)
            back, self.unread = (step_id, prev_tokens), []
        if self.since is None:
            self.since = time.monotonic()
            log.warning("holding %d requests for up to %.0f s until the ffn rank is back", self._holding(),
                        self._hold_s())
        return back

    def holds(self, take_back: Callable[[], None]) -> bool:
        """Whether requests still wait for the lost FFN (else they fail now: not held, or held too long);
        `take_back()` when it was lost between steps (a heartbeat) with nothing taken back yet."""
        if not self.wanted():
            return False
        if self.since is None:
            take_back()
        return self.within()

    def wanted(self) -> bool:
        """Whether requests are to wait for the lost FFN (else they fail now)."""
        return self._hold_s() > 0 and (self.since is not None or self._holding() > 0)

    def within(self) -> bool:
        """Whether the held requests still wait (False: `hold_s` passed, they are to fail and the hold ends)."""
        if time.monotonic() - self.since < self._hold_s():
            return True
        log.error("the ffn rank did not come back within %.0f s: failing %d held requests", self._hold_s(),
                  self._holding())
        if self.observer is not None and hasattr(self.observer, "on_hold_expired"):
            self.observer.on_hold_expired(self._holding())
        self.since = None
        return False

    def resumed(self) -> None:
        """The FFN is back: the held requests go on."""
        waited, self.since = time.monotonic() - self.since, None
        held = self._holding()
        log.info("ffn rank back after %.1f s: %d held requests go on", waited, held)
        if self.observer is not None and hasattr(self.observer, "on_resumed"):
            self.observer.on_resumed(held, waited)
