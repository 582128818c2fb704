"""An attention rank's preStop drain ends once no request runs (issue 38, found by the real-node soak).

The drain used to end after a fixed 5 s and SIGTERM followed: uvicorn then closed keep-alive
connections whose clients were sending their next request on them (a reset request, 3 of 429 in
the soak) and cut what still ran. Now the drain serves on, answering with `Connection: close`,
until the endpoint removal has spread and no HTTP request has run for a second.
"""

from __future__ import annotations

import asyncio

from afd.server.front.failover import Failover
from afd.server.probe_http import ENDPOINT_SPREAD_S, QUIET_S, DrainWatch


def test_the_drain_waits_for_the_endpoint_removal_then_for_a_quiet_second():
    now, quiet = [100.0], [0.0]
    watch = DrainWatch(lambda: quiet[0], clock=lambda: now[0])
    quiet[0] = 60.0
    assert not watch.drained()  # no drain began
    watch.begin()
    now[0] += ENDPOINT_SPREAD_S - 0.1
    assert not watch.drained()  # the endpoint removal is still spreading, however quiet
    now[0] += 0.1
    assert watch.drained()
    quiet[0] = 0.0  # a request runs (a client's next request on a connection not yet closed)
    assert not watch.drained()
    quiet[0] = QUIET_S - 0.01
    assert not watch.drained()
    quiet[0] = QUIET_S
    assert watch.drained()
    watch.begin()  # a second /drain does not restart the clock
    assert watch.drained()


def test_without_a_request_count_the_drain_ends_after_the_endpoint_removal():
    now = [0.0]
    watch = DrainWatch(None, clock=lambda: now[0])
    watch.begin()
    assert not watch.drained()
    now[0] = ENDPOINT_SPREAD_S
    assert watch.drained()


def test_failover_counts_the_requests_it_answers():
    async def scenario():
        release = asyncio.Event()

        async def app(scope, receive, send):
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok", "more_body": False})

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        sent = []

        async def send(message):
            sent.append(message)

        failover = Failover(app, lambda: True)
        await asyncio.sleep(0.02)
        assert failover.quiet_s() >= 0.02
        task = asyncio.create_task(failover({"type": "http", "method": "GET", "path": "/v1/models", "headers": []},
                                            receive, send))
        await asyncio.sleep(0.05)
        assert failover.in_flight == 1 and failover.quiet_s() == 0.0
        release.set()
        await task
        assert failover.in_flight == 0 and 0.0 < failover.quiet_s() < 0.05
        # a leaving rank closes the connection after its answer
        assert (b"connection", b"close") in sent[0]["headers"]
        await failover.client.aclose()

    asyncio.run(scenario())
