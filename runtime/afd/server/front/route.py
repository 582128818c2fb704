"""`afd route`: the front door of `afd up` as a process of its own, finding its ranks by DNS (a Kubernetes
Deployment of N replicas, `spec.router`).

It serves the OpenAI API on `AFD_HTTP_PORT` with the front door's whole behaviour (prefix-aware choice bounded by
load, 503s retried on the next rank, streams moved when their rank dies, the API key checked) over the ranks
`AFD_ROUTE_RANKS` resolves to (`discovery`), and its probes beside it on `AFD_METRICS_PORT` (`probe_http`):
`/health` is ready while it knows a ready rank and is not draining, `/live` fails when its event loop stalls,
`/drain` (preStop) turns it unready and waits until no request has run for a second, `/metrics` has the front
door's own series (`afd_front_*`; the ranks are scraped on their own). A replica keeps nothing a request needs:
any replica can take any request, and what it learnt of the ranks' prefixes is only a hint.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field

import uvicorn
from prometheus_client import Gauge

from afd.server.api.liveness import LoopWatch
from afd.server.front.discovery import RankDiscovery
from afd.server.front.door import Backends, FrontSettings, create_front_app
from afd.server.front.failover import Failover, FailoverSettings
from afd.server.probe_http import DrainWatch, Probes, start_probe_server

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouteSettings:
    """Where `afd route` listens and where its ranks are."""

    ranks: tuple[str, ...]
    host: str = "0.0.0.0"
    port: int = 8000
    metrics_port: int = 9090
    rank_http_port: int = 8000
    rank_metrics_port: int = 9090
    refresh_s: float = 2.0
    front: FrontSettings = field(default_factory=FrontSettings)


def build_router(settings: RouteSettings):
    """The ASGI app (the front door behind `Failover`, which only closes connections while draining), its probes
    and the pieces tests look at: (app, probes, discovery, backends)."""
    discovery = RankDiscovery(list(settings.ranks), settings.rank_http_port, settings.rank_metrics_port,
                              settings.refresh_s)
    backends = Backends(discovery.urls, probe_bases=discovery.probe_bases)
    front = create_front_app(backends, settings.front)
    loop_watch = LoopWatch()

    def ready() -> str | None:
        if not discovery.ranks:
            return f"no attention rank found at {', '.join(settings.ranks)}"
        if backends.watch.seen and not any(load.ready for load in backends.watch.seen.values()):
            return f"none of the {len(discovery.ranks)} attention ranks is ready"
        return None

    drain = DrainWatch(lambda: app.quiet_s())
    probes = Probes(ready, loop_watch.problem, drained=drain.drained, on_drain=drain.begin)
    # no failover URL: only `Connection: close` on every answer while draining, so clients reconnect elsewhere
    app = Failover(front, lambda: probes.draining.is_set(), FailoverSettings())
    registry = front.state.front_metrics.registry
    known = Gauge("afd_front_ranks", "Attention ranks the front door knows, by readiness", ["state"], registry=registry)
    known.labels(state="ready").set_function(lambda: sum(load.ready for load in backends.watch.seen.values()))
    known.labels(state="unready").set_function(lambda: sum(not load.ready for load in backends.watch.seen.values()))
    tasks: list[asyncio.Task] = []

    @front.on_event("startup")
    async def _find_ranks() -> None:
        await discovery.refresh()  # the first answer before the first request
        tasks.extend([asyncio.create_task(discovery.run()), asyncio.create_task(loop_watch.run())])

    @front.on_event("shutdown")
    async def _stop_finding() -> None:
        for task in tasks:
            task.cancel()

    return app, probes, discovery, backends


def run_route(settings: RouteSettings) -> int:
    """Serve until SIGTERM or Ctrl-C; in-flight relays get `front.shutdown_grace_s`, then are cut."""
    if not settings.ranks:
        raise ValueError("afd route needs the attention ranks: --ranks or AFD_ROUTE_RANKS (DNS names or URLs)")
    app, probes, _, _ = build_router(settings)
    start_probe_server(settings.host, settings.metrics_port, probes, app.app.state.front_metrics.registry)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                                           timeout_keep_alive=30,
                                           timeout_graceful_shutdown=max(1, round(settings.front.shutdown_grace_s))))
    log.info("afd route: serving on %s:%d, probes on %d, ranks from %s", settings.host, settings.port,
             settings.metrics_port, ", ".join(settings.ranks))
    for signum in (signal.SIGTERM, signal.SIGINT):  # uvicorn re-raises the signal it stopped on: exit 0, not by it
        signal.signal(signum, lambda *_: setattr(server, "should_exit", True))
    server.run()
    return 0
