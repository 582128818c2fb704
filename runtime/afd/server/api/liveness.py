"""Is the HTTP event loop still turning? A heartbeat task the probes can read from any thread.

The probe server runs in its own thread, so it answers even when the API's event loop is
blocked or gone; without this it would report a healthy rank that cannot serve.
"""

from __future__ import annotations

import asyncio
import time


class LoopWatch:
    """`run()` ticks on the loop; `problem()` (any thread) says when the ticks stopped."""

    def __init__(self, stall_s: float = 10.0, tick_s: float = 0.5):
        self.stall_s = stall_s
        self.tick_s = tick_s
        self.last: float | None = None  # None until the loop starts: nothing to judge yet

    async def run(self) -> None:
        while True:
            self.last = time.monotonic()
            await asyncio.sleep(self.tick_s)

    def problem(self) -> str | None:
        if self.last is None:
            return None
        silent = time.monotonic() - self.last
        if silent > self.stall_s:
            return f"the HTTP event loop has not run for {silent:.0f} s (blocked or stopped)"
        return None
