"""`afd route`'s probes: ready while it knows a ready rank, not while none answers; a drain turns it unready and
its answers say `Connection: close` (clients reconnect to another router replica) while it serves on."""

from __future__ import annotations

import time

from starlette.testclient import TestClient

from afd.server.front.route import RouteSettings, build_router
from tests.server.test_up import wait_for


def test_ready_only_with_a_ready_rank_and_closing_connections_while_draining():
    app, probes, discovery, backends = build_router(RouteSettings(ranks=("http://127.0.0.1:9",)))  # nothing listens
    assert probes.readiness() is None  # a fixed rank, not probed yet
    with TestClient(app) as client:
        wait_for(lambda: backends.watch.seen, 10, "the first poll of the ranks")
        assert "none of the 1 attention ranks is ready" in probes.readiness()
        assert probes.liveness() is None
        answer = client.get("/v1/models")
        assert answer.status_code == 503 and answer.headers.get("connection") != "close"
        probes.draining.set()
        answer = client.get("/v1/models")
        assert answer.status_code == 503 and answer.headers["connection"] == "close"
        assert probes.readiness() == "draining: the pod is stopping"


def test_without_ranks_found_the_router_is_not_ready():
    async def nothing(name):
        return []

    app, probes, discovery, _ = build_router(RouteSettings(ranks=("demo-ranks.ns.svc",)))
    discovery._resolve = nothing
    with TestClient(app):
        time.sleep(0.1)
        assert probes.readiness() == "no attention rank found at demo-ranks.ns.svc"


def test_the_router_checks_the_api_key_as_the_ranks_do():
    from afd.server.api.api_keys import ApiKeys
    from afd.server.front.door import FrontSettings

    app, _, _, _ = build_router(RouteSettings(ranks=("http://127.0.0.1:9",), front=FrontSettings(api_keys=ApiKeys(("k1",)))))
    with TestClient(app) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 503  # no rank answers
