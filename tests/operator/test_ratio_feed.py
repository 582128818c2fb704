"""The ratio feed: what it scrapes (the ranks' /metrics or Prometheus), when, and what it keeps."""

from __future__ import annotations

from afd.planner.simulate import FakePrometheus, SimulatedGroup
from afd_operator.model.spec import parse_spec
from afd_operator.groups.observe import PodFacts
from afd_operator.ratio.feed import RatioFeed
from op_testkit import make_cr

T0 = 1_800_000_000.0


RANKS = {"10.0.0.0": ("attention", 0), "10.0.0.1": ("attention", 1), "10.0.0.2": ("ffn", 0)}  # pod IP → rank


def pods_of(body, group=0):
    revision = parse_spec(body["spec"]).revision
    return [PodFacts(f"demo-g{group}-{'attn' if role == 'attention' else 'ffn'}-{rank}", group, role, revision,
                     "Running", True, 0, T0, ip=ip) for ip, (role, rank) in RANKS.items()]


class Ranks:
    """Every rank's /metrics of one simulated 2A1F group, by URL."""

    def __init__(self):
        self.group, self.asked = SimulatedGroup("2A1F"), []

    def get(self, url):
        self.asked.append(url)
        self.group.run(16)
        role, rank = RANKS[url.split("/")[2].split(":")[0]]
        return "\n".join(line for line in self.group.exposition().splitlines()
                         if f'role="{role}",rank="{rank}"' in line) + "\n"


def test_scrapes_every_rank_each_interval_and_keeps_the_last_samples():
    body = make_cr(ratio={"mode": "Advise", "sampleIntervalSeconds": 30, "samples": 2})
    ranks = Ranks()
    feed = RatioFeed(ranks.get)
    first = feed.collect(body, pods_of(body), T0)
    assert sorted(ranks.asked) == [f"http://10.0.0.{i}:9090/metrics" for i in range(3)]
    assert {(s.role, s.rank) for s in first[0][0]} == {("attention", 0), ("attention", 1), ("ffn", 0)}
    assert len(feed.collect(body, pods_of(body), T0 + 10)[0]) == 1 and len(ranks.asked) == 3  # not due yet
    for tick in (1, 2, 3):
        kept = feed.collect(body, pods_of(body), T0 + 30 * tick)
    assert len(kept[0]) == 2 and kept[0][-1][0].at == T0 + 90


def test_a_new_revision_starts_afresh_and_off_forgets():
    body = make_cr(ratio={"mode": "Advise"})
    ranks = Ranks()
    feed = RatioFeed(ranks.get)
    feed.collect(body, pods_of(body), T0)
    old_pods = pods_of(body)
    body["spec"]["image"] = "registry.example/afd-runtime:0.2.0"
    assert feed.collect(body, old_pods, T0 + 60) == {}  # old pods are not read for the new revision
    assert len(feed.collect(body, pods_of(body), T0 + 120)[0]) == 1
    body["spec"]["ratio"]["mode"] = "Off"
    assert feed.collect(body, pods_of(body), T0 + 180) == {}


def test_an_unreadable_rank_skips_its_group_this_round():
    def refuse(url):
        raise OSError("connection refused")

    body = make_cr(ratio={"mode": "Advise"})
    assert RatioFeed(refuse).collect(body, pods_of(body), T0) == {}


def no_http(url):
    raise AssertionError(f"scraped {url} although spec.ratio names a Prometheus")


def test_reads_prometheus_when_the_spec_names_one():
    fake = FakePrometheus()
    group = SimulatedGroup("2A1F")
    group.run(16)
    fake.record(T0, group.exposition(), afd_io_name="demo", afd_io_group="0", namespace="ns")
    server = fake.serve()
    try:
        body = make_cr(ratio={"mode": "Advise", "prometheusURL": f"http://127.0.0.1:{server.server_port}"})
        kept = RatioFeed(no_http).collect(body, pods_of(body), T0)
    finally:
        server.shutdown()
    assert {(s.role, s.rank) for s in kept[0][0]} == {("attention", 0), ("attention", 1), ("ffn", 0)}
    assert kept[0][0][0].info["topology"] == "2A1F"


def test_the_handler_feeds_the_scrapes_to_the_reconcile():
    import asyncio

    from afd_operator.handlers import OperatorMemo, reconcile_one
    from op_testkit import FakeStore

    body = make_cr(ratio={"mode": "Advise"})
    ranks, store = Ranks(), FakeStore()
    memo = OperatorMemo(store=store)
    memo.feed = RatioFeed(ranks.get)
    memo.pods[("ns", "demo")] = {p.name: p for p in pods_of(body)}
    outcome = asyncio.run(reconcile_one(memo, body, full=False))
    assert len(ranks.asked) == 3
    assert "too few metrics: need at least two scrapes" in outcome.status["ratio"]["reason"]
    assert store.statuses[-1]["ratio"] == outcome.status["ratio"]
