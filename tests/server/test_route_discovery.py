"""`afd route` finds its ranks by DNS: each address a rank, ranks that leave dropped, new ones added, a failed lookup
keeping what it had, a name with no Ready pod (NXDOMAIN) having none."""

from __future__ import annotations

import asyncio
import socket

from afd.server.front.discovery import RankDiscovery, rank_url


class Dns:
    def __init__(self):
        self.answers: dict[str, object] = {}

    async def __call__(self, name: str) -> list[str]:
        answer = self.answers[name]
        if isinstance(answer, BaseException):
            raise answer
        return list(answer)


def test_ranks_follow_what_the_names_resolve_to():
    dns = Dns()
    found = RankDiscovery(["demo-ranks.ns.svc", "http://127.0.0.1:7000/"], http_port=8000, metrics_port=9090,
                          resolve=dns)
    assert found.urls() == ["http://127.0.0.1:7000"]  # fixed ranks from the start
    dns.answers["demo-ranks.ns.svc"] = ["10.0.0.2", "10.0.0.1"]
    asyncio.run(found.refresh())
    assert sorted(found.urls()) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://127.0.0.1:7000"]
    assert found.probe_bases()["http://10.0.0.1:8000"] == "http://10.0.0.1:9090"

    dns.answers["demo-ranks.ns.svc"] = ["10.0.0.2", "10.0.0.3"]  # one pod left the Ready set, a new group came
    asyncio.run(found.refresh())
    assert sorted(found.urls()) == ["http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://127.0.0.1:7000"]

    dns.answers["demo-ranks.ns.svc"] = socket.gaierror(socket.EAI_AGAIN, "temporary failure")
    asyncio.run(found.refresh())
    assert len(found.urls()) == 3  # the DNS server did not answer: keep the ranks

    dns.answers["demo-ranks.ns.svc"] = socket.gaierror(socket.EAI_NONAME, "no such name")
    asyncio.run(found.refresh())
    assert found.urls() == ["http://127.0.0.1:7000"]  # no Ready pod behind the Service


def test_ipv6_addresses_make_bracketed_urls():
    assert rank_url("fd00::5", 8000) == "http://[fd00::5]:8000" and rank_url("10.1.2.3", 80) == "http://10.1.2.3:80"


def test_a_real_name_resolves():
    found = RankDiscovery(["localhost"], http_port=8123, metrics_port=9123)
    asyncio.run(found.refresh())
    assert "http://127.0.0.1:8123" in found.urls()
