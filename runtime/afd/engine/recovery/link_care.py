"""The engine's FFN link between steps: heartbeat it while healthy, re-handshake it once lost.

It runs on the engine thread with no step in flight (the engine drains first), so a
re-handshake never races a step's transfers. `error` is the link's state as the server
sees it: None while it serves, else why requests are refused until the FFN is back.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from afd.connector.base import PeerLeft

log = logging.getLogger(__name__)


class LinkCare:
    """Looks after one `AttentionLink` every `check_s` seconds; `lose` records a loss seen by a step."""

    def __init__(self, link, check_s: float):
        self.link, self.check_s = link, check_s
        self.error: str | None = None  # the FFN link is down (recoverable)
        self.reconnects = 0
        self._next_check = 0.0

    def due(self) -> bool:
        return time.monotonic() >= self._next_check

    def tend(self, idle: Callable[[], bool]) -> None:
        """Heartbeat a healthy link (leaving a draining FFN once `idle()`); try to re-handshake a lost one."""
        self._next_check = time.monotonic() + self.check_s
        if self.error is None:
            try:
                self.link.keepalive()
                if self.link.leave_if_done(idle()):
                    self.error = f"the ffn rank is stopping ({self.link.ffn_draining}); waiting for it to come back"
            except Exception as err:
                self.lose(err)
            return
        try:
            self.link.recover()
        except Exception as err:
            log.debug("ffn link not back yet: %s", err)
            return
        log.info("ffn link recovered; serving again")
        self.reconnects += 1
        self.error = None

    def lose(self, err: Exception) -> None:
        """Record the loss; a goodbye from the FFN rank (a planned stop) is logged at INFO, anything else at ERROR."""
        if self.error is None:
            if isinstance(err, PeerLeft):
                log.info("ffn link closed by its ffn rank (%s); waiting for it to come back", err)
            else:
                log.error("ffn link lost: %s", err)
        self.error = f"{type(err).__name__}: {err}"
