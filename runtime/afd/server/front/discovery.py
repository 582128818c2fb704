"""Where `afd route` finds the attention ranks: DNS names resolved again and again, each address one rank.

On Kubernetes the operator renders a headless Service over the attention pods of every group of a deployment,
without `publishNotReadyAddresses`: its DNS name resolves to the Ready pods only (warmed up, FFN linked, not
draining), groups added or removed by scaling included, and reading it needs no API access (no Role, no
service-account token). Every `refresh_s` the names are resolved again: a rank whose address is gone is dropped,
a new one is added. A name that does not exist (NXDOMAIN: a Service with no Ready pod) has no ranks; a failed
lookup (the DNS server did not answer) keeps what the name had. Between lookups the front door's own probes
(`rank_watch`) see a rank turn unready within a second. `http://host:port` targets are fixed ranks (tests, local).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Awaitable, Callable

log = logging.getLogger(__name__)
Resolve = Callable[[str], Awaitable[list[str]]]
_NO_SUCH_NAME = {getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name)}


async def resolve_addresses(name: str) -> list[str]:
    """The IP addresses `name` resolves to now (`socket.gaierror` when it cannot)."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def rank_url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


class RankDiscovery:
    """The attention ranks behind `targets`: rank URL → its probe base (`/health`, `/metrics`)."""

    def __init__(self, targets: list[str], http_port: int = 8000, metrics_port: int = 9090, refresh_s: float = 2.0,
                 resolve: Resolve = resolve_addresses):
        self.names = [t for t in targets if not t.startswith(("http://", "https://"))]
        self.fixed = {t.rstrip("/"): t.rstrip("/") for t in targets if t.startswith(("http://", "https://"))}
        self.http_port, self.metrics_port, self.refresh_s, self._resolve = http_port, metrics_port, refresh_s, resolve
        self._addresses: dict[str, list[str]] = {name: [] for name in self.names}
        self.ranks: dict[str, str] = dict(self.fixed)

    def urls(self) -> list[str]:
        return list(self.ranks)

    def probe_bases(self) -> dict[str, str]:
        return dict(self.ranks)

    async def refresh(self) -> None:
        """Resolve every name once and make the rank set what they say now."""
        answers = await asyncio.gather(*(self._resolve(name) for name in self.names), return_exceptions=True)
        for name, answer in zip(self.names, answers):
            if isinstance(answer, socket.gaierror) and answer.errno in _NO_SUCH_NAME:
                answer = []  # no Ready pod behind the Service now
            if isinstance(answer, BaseException):
                log.warning("could not resolve %s (%s): keeping its %d rank(s)", name, answer, len(self._addresses[name]))
                continue
            self._addresses[name] = answer
        ranks = dict(self.fixed)
        for address in sorted({a for addresses in self._addresses.values() for a in addresses}):
            ranks[rank_url(address, self.http_port)] = rank_url(address, self.metrics_port)
        if set(ranks) != set(self.ranks):
            log.info("attention ranks: %d (%s)", len(ranks), ", ".join(sorted(ranks)) or "none")
        self.ranks = ranks

    async def run(self) -> None:
        """Refresh every `refresh_s` until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_s)
