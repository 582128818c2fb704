"""What each attention rank says of its load, polled by the front door: readiness and the serving gauges.

Every `interval_s` the watch asks each rank's probe endpoint for `/health` (readiness: 503 while it warms up,
drains, or holds its requests for a lost FFN rank) and `/metrics` (`afd_requests_running`, `afd_requests_waiting`,
`afd_kv_cache_usage_ratio`). A rank that does not answer is unready until it does. Another front door replica's
requests show in these gauges; this one's own in-flight count (`Backends.in_flight`) is exact and immediate, so the
load a choice uses is the larger of the two (`loads`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import httpx

from afd.server.front.prefix_choice import RankLoad

log = logging.getLogger(__name__)
RUNNING, WAITING, KV_USAGE = "afd_requests_running", "afd_requests_waiting", "afd_kv_cache_usage_ratio"


def gauges(exposition: str) -> tuple[float, float]:
    """(running + waiting requests, KV-cache use) summed over a rank's Prometheus text (one rank per text)."""
    requests = kv = 0.0
    for line in exposition.splitlines():
        if not line.startswith(("afd_requests_", "afd_kv_cache_usage")):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if name in (RUNNING, WAITING):
            requests += value
        elif name == KV_USAGE:
            kv = max(kv, value)
    return requests, kv


class RankWatch:
    """The last readiness and gauges of each rank; `run()` polls them until cancelled."""

    def __init__(self, probe_bases: Callable[[], dict[str, str]], interval_s: float = 1.0, timeout_s: float = 2.0):
        self.probe_bases = probe_bases  # rank URL → where its /health and /metrics are
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.seen: dict[str, RankLoad] = {}

    def loads(self, ranks: list[str], in_flight: dict[str, int]) -> dict[str, RankLoad]:
        """Each rank's load for a choice: unknown ranks are taken as ready and idle until polled."""
        loads = {}
        for rank in ranks:
            seen = self.seen.get(rank) or RankLoad()
            loads[rank] = RankLoad(max(seen.requests, in_flight.get(rank, 0)), seen.kv_usage, seen.ready)
        return loads

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.poll(client)
            await asyncio.sleep(self.interval_s)

    async def poll(self, client: httpx.AsyncClient) -> None:
        """One round over every rank."""
        bases = self.probe_bases()
        answers = await asyncio.gather(*(self._probe(client, base) for base in bases.values()))
        self.seen = dict(zip(bases, answers))

    async def _probe(self, client: httpx.AsyncClient, base: str) -> RankLoad:
        try:
            health, metrics = await asyncio.gather(client.get(f"{base}/health", timeout=self.timeout_s),
                                                   client.get(f"{base}/metrics", timeout=self.timeout_s))
        except httpx.HTTPError as err:
            log.debug("rank at %s did not answer its probes: %s", base, err)
            return RankLoad(ready=False)
        requests, kv = gauges(metrics.text) if metrics.status_code == 200 else (0.0, 0.0)
        return RankLoad(requests, kv, health.status_code == 200)
