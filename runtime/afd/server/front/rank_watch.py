"""What each attention rank says of its load, polled by the front door: readiness and the serving gauges.

Every `interval_s` the watch asks each rank's probe endpoint for `/health` (readiness: 503 while it warms up,
drains, or holds its requests for a lost FFN rank) and `/metrics` (`afd_requests_running`, `afd_requests_waiting`,
`afd_kv_cache_usage_ratio`). A rank that does not answer is unready until it does. The gauges count every front
door replica's requests; this replica's own in-flight count (`Backends.in_flight`) is exact and immediate. So the
load a choice uses is this replica's requests now plus the others' as of the last poll (the gauges less what this
replica had in flight when it polled): a poll that caught this replica's own request, over by now, does not make the
rank look busy until the next one.
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

    def __init__(self, probe_bases: Callable[[], dict[str, str]], in_flight: Callable[[], dict[str, int]] = dict,
                 interval_s: float = 1.0, timeout_s: float = 2.0):
        self.probe_bases = probe_bases  # rank URL → where its /health and /metrics are
        self.in_flight = in_flight  # this replica's requests on each rank now
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.seen: dict[str, RankLoad] = {}  # as polled; `requests`: the other replicas' requests on the rank

    def loads(self, ranks: list[str]) -> dict[str, RankLoad]:
        """Each rank's load for a choice: unknown ranks are taken as ready and idle until polled."""
        own, loads = self.in_flight(), {}
        for rank in ranks:
            seen = self.seen.get(rank) or RankLoad()
            loads[rank] = RankLoad(own.get(rank, 0) + seen.requests, seen.kv_usage, seen.ready)
        return loads

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.poll(client)
            await asyncio.sleep(self.interval_s)

    async def poll(self, client: httpx.AsyncClient) -> None:
        """One round over every rank."""
        bases, own = self.probe_bases(), dict(self.in_flight())
        answers = await asyncio.gather(*(self._probe(client, base) for base in bases.values()))
        for rank, answer in zip(bases, answers):
            answer.requests = max(0.0, answer.requests - own.get(rank, 0))
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
