"""The probes see an HTTP event loop that stopped turning."""

import asyncio
import time

from afd.server.api.liveness import LoopWatch


def test_a_blocked_loop_is_reported_and_a_turning_one_is_not():
    watch = LoopWatch(stall_s=0.3, tick_s=0.05)
    assert watch.problem() is None  # not started: nothing to judge

    async def main():
        ticking = asyncio.create_task(watch.run())
        await asyncio.sleep(0.2)
        assert watch.problem() is None
        time.sleep(0.5)  # a handler that blocks the loop (say, tokenizing 50 MB inline)
        blocked = watch.problem()
        await asyncio.sleep(0.1)
        ticking.cancel()
        return blocked, watch.problem()

    blocked, recovered = asyncio.run(main())
    assert "has not run for" in blocked and recovered is None
