"""Per-layer timings of sampled profile steps, cheap enough to leave on.

Only every N-th step is profiled (its plan carries `profile`, so the FFN rank profiles
the same step). A profiled step records marks — host clock readings on CPU, CUDA
events on GPU — and nothing is read until the step has ended, so no layer ever
waits for the device. Unprofiled steps pay one attribute check per mark.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

KINDS = ("compute", "send", "recv")


class LayerClock:
    """Marks (kind, layer) intervals during one step; `collect()` turns them into seconds afterwards."""

    def __init__(self, device: torch.device | str = "cpu", profile_every: int = 16, capacity: int = 4096):
        self.profile_every = profile_every
        self.cuda = torch.device(device).type == "cuda"
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(capacity)] if self.cuda else []
        self._used = 0
        self._marks: list[tuple[str, int, object, object]] = []
        self.active = False

    def should_profile(self, step_id: int) -> bool:
        return bool(self.profile_every) and step_id % self.profile_every == 0

    def begin(self, active: bool) -> None:
        self.active, self._used = active, 0
        self._marks.clear()

    def now(self):
        """A point in time: a host reading, or a recorded CUDA event (None when not profiling)."""
        if not self.active:
            return None
        if not self.cuda:
            return time.perf_counter()
        if self._used >= len(self._events):
            return None  # more marks than events: drop the rest rather than allocate mid-step
        event = self._events[self._used]
        self._used += 1
        event.record()
        return event

    def lap(self, kind: str, layer: int, since) -> None:
        """Close the interval opened at `since` (from `now()`)."""
        if self.active and since is not None:
            end = self.now()
            if end is not None:
                self._marks.append((kind, layer, since, end))

    def collect(self) -> list[tuple[str, int, float]]:
        """(kind, layer, seconds) of the step just finished; call after it has completed."""
        if not self.active:
            return []
        self.active = False
        if self.cuda:
            self._marks[-1][3].synchronize() if self._marks else None
            return [(kind, layer, start.elapsed_time(end) / 1e3) for kind, layer, start, end in self._marks]
        return [(kind, layer, end - start) for kind, layer, start, end in self._marks]


class NullClock(LayerClock):
    """The clock of a runner nobody observes."""

    def __init__(self):
        super().__init__("cpu", profile_every=0, capacity=0)


@dataclass(frozen=True)
class StepInstruments:
    """What a runner reports to, fixed at construction: per-layer timings of profiled steps, each step."""

    clock: LayerClock | NullClock = field(default_factory=lambda: NullClock())
    on_layers: Callable[[list], None] | None = None  # (kind, layer, seconds) of each profiled step
    on_step: Callable[[float, int], None] | None = None  # (seconds, rows) of every step
