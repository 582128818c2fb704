"""Engine outputs from the engine's output thread to the HTTP event loop, one wake-up per burst.

The engine delivers every request's output of a step one after another on its output thread.
Waking the event loop for each (`call_soon_threadsafe` writes to the loop's self-pipe: a
system call, then a loop iteration, per token per request) was most of the loop's cost per
token. Here the first output of a burst schedules one flush and the others only join the
list, so a step of N requests wakes the loop about once, and each request's stream takes
every output that arrived for it at once.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque

from afd.engine.request import RequestOutput

_handoffs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class LoopHandoff:
    """Collects outputs from any thread; delivers them on `loop` in arrival order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[OutputSink, RequestOutput]] = []
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopHandoff":
        """The handoff of `loop` (one per loop: every request on it shares the wake-ups)."""
        handoff = _handoffs.get(loop)
        if handoff is None:
            handoff = _handoffs[loop] = cls(loop)
        return handoff

    def put(self, sink: "OutputSink", output: RequestOutput) -> None:
        """Any thread. Raises like `call_soon_threadsafe` when the loop is closed."""
        with self._lock:
            self._pending.append((sink, output))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except BaseException:
            with self._lock:
                self._scheduled = False
            raise

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for sink, output in pending:
            sink.push(output)


class OutputSink:
    """One request's outputs on the event loop: `take` waits for at least one, returns all there are."""

    def __init__(self):
        self._ready: deque[RequestOutput] = deque()
        self._waiter: asyncio.Future | None = None

    def push(self, output: RequestOutput) -> None:
        self._ready.append(output)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[RequestOutput]:
        while not self._ready:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        taken = list(self._ready)
        self._ready.clear()
        return taken
