"""Where the server's CPU goes, for `output_path.py`: stage timers wrapped around the output path's seams
(whichever of them a tree has), and CPU seconds per thread of this process and of its API children.

Imported by the server process only (`output_path_server`), inside the tree under test: the seams are
looked up in that tree's `afd`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

STAGES = ("deliver", "detokenize", "stop", "handoff", "format", "write")


class Timers:
    """CPU seconds of the calling thread per stage (wall time would count waits for the GIL); wraps
    callables in place, at about a microsecond per call."""

    def __init__(self):
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.present: set[str] = set()

    def wrap(self, owner, name: str, stage: str) -> bool:
        inner = getattr(owner, name, None)
        if inner is None:
            return False
        seconds, clock = self.seconds, time.thread_time

        def timed(*args, **kwargs):
            started = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[stage] += clock() - started

        setattr(owner, name, timed)
        self.present.add(stage)
        return True


def instrument(timers: Timers) -> None:
    """Stage timers on whichever of the known seams this tree has."""
    import json as json_module

    from afd.engine import outputs
    from afd.engine.text import detokenizer, stop_strings
    from afd.server.api import app

    timers.wrap(outputs.OutputProcessor, "_deliver", "deliver")
    timers.wrap(detokenizer.IncrementalDetokenizer, "add", "detokenize")
    timers.wrap(stop_strings.StopChecker, "add", "stop")
    timers.wrap(stop_strings.StopChecker, "take", "stop")
    for name in ("completion_chunk", "chat_chunk"):  # looked up in app's globals at call time
        timers.wrap(app, name, "format")
    with contextlib.suppress(ImportError):  # a tree that formats each event from a template
        from afd.server.api import sse

        for name in ("completion", "chat", "usage"):
            timers.wrap(sse.StreamEvents, name, "format")
    if hasattr(app, "_Outputs") or hasattr(app, "streams"):  # a tree that takes outputs per request on the loop
        _wrap_handoff(timers, app)
    timers.wrap(asyncio.Queue, "put_nowait", "handoff")  # a tree that hands each output over on its own
    with contextlib.suppress(ImportError):
        from afd.server.api import handoff

        timers.wrap(handoff.LoopHandoff, "_flush", "handoff")  # a tree that hands a step's outputs over at once
    from asyncio import selector_events

    import h11

    timers.wrap(h11.Connection, "send", "write")  # uvicorn's HTTP/1.1 framing, then the socket write
    timers.wrap(selector_events._SelectorSocketTransport, "write", "write")

    class TimedJson:  # app's json.dumps: the SSE line of each chunk
        loads = json_module.loads

        @staticmethod
        def dumps(*args, **kwargs):
            started = time.thread_time()
            try:
                return json_module.dumps(*args, **kwargs)
            finally:
                timers.seconds["format"] += time.thread_time() - started

    app.json = TimedJson


def _wrap_handoff(timers: Timers, app) -> None:
    """Time the callbacks the engine calls with each output (the thread-safe handoff to the loop)."""
    from afd.engine.engine import Engine

    submit = Engine.submit
    seconds, clock = timers.seconds, time.thread_time
    timers.present.add("handoff")

    def timed_submit(self, prompt_ids, params, on_output, *args, **kwargs):
        def timed(*a, **k):
            started = clock()
            try:
                return on_output(*a, **k)
            finally:
                seconds["handoff"] += clock() - started

        return submit(self, prompt_ids, params, timed, *args, **kwargs)

    Engine.submit = timed_submit


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every live thread of this process, by thread name (summed over equal names)."""
    import threading

    result: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, TypeError):
            continue
        name = thread.name.split("_")[0].rstrip("0123456789-")
        result[name] = result.get(name, 0.0) + seconds
    return result


def proc_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of another process: in all, and by thread name as the kernel knows it (`comm`)."""
    tick = os.sysconf("SC_CLK_TCK")
    result: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = "api:" + (task / "comm").read_text().strip().split("/")[0].rstrip("0123456789-")
            result[name] = result.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return result


def child_pids() -> list[int]:
    return [int(pid) for task in Path("/proc/self/task").iterdir() for pid in (task / "children").read_text().split()]
