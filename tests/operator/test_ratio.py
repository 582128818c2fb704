"""spec.ratio by simulation: groups with known costs (afd.planner.simulate) run under the
operator's reconcile, tick by tick; their pods follow its rollout, their metrics feed it."""

from __future__ import annotations

from dataclasses import dataclass, replace


from afd.planner.simulate import SimulatedGroup
from afd.config.topology import Topology
from afd_operator.model.spec import parse_spec
from afd_operator.groups.observe import PodFacts
from afd_operator.ratio.recommend import CONFIRMATIONS, Fleet, decide, effective_spec, max_unavailable
from afd_operator.reconcile.deployment import reconcile
from op_testkit import FakeStore, make_cr

T0 = 1_800_000_000.0
ATTENTION_BOUND = dict(attention=(2e-3, 8e-4), ffn=(1e-3, 1e-5))
FFN_BOUND = dict(attention=(1e-3, 1e-6), ffn=(2e-2, 2e-4), host=(1e-4, 0))
LOADS = (8, 16, 32, 24)  # decoding sequences per GPU, cycled: a fit needs more than one batch size


@dataclass
class SimGroup:
    revision: str
    topology: str
    runtime: SimulatedGroup
    ready: bool = False


class Cluster:
    """One AFDDeployment, its pods and their metrics. Each tick the Ready groups serve a load and
    are scraped, the reconciler runs, and the pods follow its status: a new or replaced group
    gets pods of its revision and topology, Ready one tick later."""

    def __init__(self, costs: dict, noise: float = 0.0, tick_s: float = 30.0, **spec):
        self.body = make_cr(**spec)
        self.costs, self.tick_s, self.noise = costs, tick_s, noise
        self.store, self.now, self.ticks, self.posted = FakeStore(), T0, 0, []
        self.groups: dict[int, SimGroup] = {}
        self.scrapes: dict[int, list] = {}
        self.history: list[tuple[float, str, int]] = []  # (time, topology of status, Ready groups)

    @property
    def status(self) -> dict:
        return self.body.get("status") or {}

    @property
    def ratio(self) -> dict:
        return self.status.get("ratio") or {}

    def events(self, reason: str) -> list[str]:
        return [event.message for event in self.posted if event.reason == reason]

    def tick(self, loads=LOADS) -> None:
        self.now += self.tick_s
        self.ticks += 1
        samples = parse_spec(self.body["spec"]).ratio.samples
        for index, group in self.groups.items():
            if group.ready:
                shape = Topology.parse(group.topology)
                group.runtime.run(loads[self.ticks % len(loads)] * (shape.num_attention + shape.num_ffn))
                scrape = [replace(s, at=self.now) for s in group.runtime.scrapes([])[0]]
                self.scrapes[index] = (self.scrapes.get(index, []) + [scrape])[-samples:]
        outcome = reconcile(self.body, self._pods(), self.store, self.now, scrapes=self.scrapes)
        self.body["status"] = outcome.status
        self.posted += outcome.events
        for entry in outcome.status["groups"]:
            index, revision = entry["index"], entry["revision"]
            group = self.groups.get(index)
            if group is None or group.revision != revision:
                runtime = SimulatedGroup(entry["topology"], noise=self.noise, seed=self.ticks, **self.costs)
                self.groups[index] = SimGroup(revision, entry["topology"], runtime)
                self.scrapes.pop(index, None)
            else:
                group.ready = True
        for index in set(self.groups) - {g["index"] for g in outcome.status["groups"]}:
            del self.groups[index]
        ready = sum(g.ready for g in self.groups.values())
        self.history.append((self.now, outcome.status["topology"], ready))

    def run(self, ticks: int, loads=LOADS) -> "Cluster":
        for _ in range(ticks):
            self.tick(loads)
        return self

    def changes(self) -> list[tuple[float, str]]:
        """(time, new topology) each time the deployment's topology changed."""
        out, last = [], None
        for when, topology, _ in self.history:
            if last is not None and topology != last:
                out.append((when, topology))
            last = topology
        return out

    def _pods(self) -> list[PodFacts]:
        pods = []
        for index, group in self.groups.items():
            shape = Topology.parse(group.topology)
            for role, short, ranks in (("attention", "attn", shape.num_attention), ("ffn", "ffn", shape.num_ffn)):
                pods += [PodFacts(f"demo-g{index}-{short}-{rank}", index, role, group.revision, "Running",
                                  group.ready, 0, T0 - 100) for rank in range(ranks)]
        return pods


def attention_bound(**spec) -> Cluster:
    """1A1F groups whose attention dominates: 5A1F is best per GPU (maxRanksPerGroup 6)."""
    return Cluster(ATTENTION_BOUND, attention={"ranks": 1}, **spec)


def ratio(mode: str, **fields) -> dict:
    return {"mode": mode, "maxRanksPerGroup": 6, "cooldownSeconds": 600, **fields}


def per_ffn(topology: str) -> float:
    shape = Topology.parse(topology)
    return shape.num_attention / shape.num_ffn


class TestAdvise:
    def test_attention_bound_groups_are_advised_more_attention_ranks_and_nothing_moves(self):
        cluster = attention_bound(replicas=2, ratio=ratio("Advise")).run(8)
        assert per_ffn(cluster.ratio["recommended"]) > 1, cluster.ratio["reason"]
        assert cluster.ratio["predictedGainPercent"] >= 15 and "attention computes" in cluster.ratio["reason"]
        [event] = cluster.events("RatioRecommended")
        assert event.startswith(f"{cluster.ratio['recommended']} instead of 1A1F")
        assert cluster.changes() == [] and cluster.status["topology"] == "1A1F"
        busy = cluster.ratio["groups"][0]
        assert busy["attentionBusyPercent"] > busy["ffnBusyPercent"]

    def test_ffn_bound_groups_are_advised_fewer_attention_ranks_per_ffn(self):
        cluster = Cluster(FFN_BOUND, attention={"ranks": 4}, ratio=ratio("Advise")).run(6)
        assert per_ffn(cluster.ratio["recommended"]) < 4, cluster.ratio["reason"]
        [group] = cluster.ratio["groups"]
        assert group["ffnBusyPercent"] > group["attentionBusyPercent"]

    def test_too_few_samples_give_no_recommendation_and_say_why(self):
        cluster = attention_bound(ratio=ratio("Advise")).run(3)  # Ready after tick 2: one scrape
        assert cluster.ratio["recommended"] is None
        assert "too few metrics: need at least two scrapes" in cluster.ratio["reason"]
        assert cluster.events("RatioRecommended") == []

    def test_one_steady_load_gives_no_recommendation(self):
        cluster = attention_bound(ratio=ratio("Advise")).run(8, loads=(16,))
        assert cluster.ratio["recommended"] is None and "same batch" in cluster.ratio["reason"]

    def test_bounds_are_respected(self):
        cluster = attention_bound(ratio=ratio("Advise", maxAttentionPerFFN=2)).run(8)
        assert cluster.ratio["recommended"] in ("2A1F", "4A2F")

    def test_off_writes_no_ratio_status(self):
        cluster = Cluster(ATTENTION_BOUND).run(6)
        assert cluster.status.get("ratio") is None
        assert not any(event.reason.startswith("Ratio") for event in cluster.posted)


class TestAuto:
    def test_moves_once_through_the_rollout_and_then_holds(self):
        cluster = attention_bound(replicas=2, rollout={"maxSurge": 1, "maxUnavailable": 0},
                          ratio=ratio("Auto", cooldownSeconds=0)).run(30)
        [(_, moved_to)] = cluster.changes()
        assert per_ffn(moved_to) > 1 and len(cluster.events("RatioChanged")) == 1
        assert cluster.ratio["appliedTopology"] == moved_to and cluster.status["availableReplicas"] == 2
        assert {g["topology"] for g in cluster.status["groups"]} == {moved_to}
        assert cluster.ratio.get("recommended", moved_to) == moved_to  # the new shape is kept

    def test_noisy_metrics_do_not_flap(self):
        cluster = attention_bound(noise=0.05, replicas=2, rollout={"maxSurge": 1},
                          ratio=ratio("Auto", cooldownSeconds=0)).run(40)
        assert len(cluster.changes()) == 1 and len(cluster.events("RatioChanged")) == 1
        assert len(cluster.events("RatioRecommended")) == 1

    def test_a_recommendation_must_be_confirmed(self):
        cluster = attention_bound(ratio=ratio("Auto"), rollout={"maxSurge": 1})
        while cluster.ratio.get("recommended") is None:
            cluster.tick()
        assert cluster.ratio["appliedTopology"] is None and f"1 of {CONFIRMATIONS}" in cluster.ratio["reason"]

    def test_cool_down_spaces_the_changes(self):
        cluster = attention_bound(rollout={"maxSurge": 1}, ratio=ratio("Auto", cooldownSeconds=1800))
        while not cluster.changes():
            cluster.tick()
        first = cluster.changes()[0][0]
        cluster.costs = FFN_BOUND  # the workload turns FFN-bound: the ratio should come down again
        for group in cluster.groups.values():
            group.runtime.lines = SimulatedGroup(group.topology, **FFN_BOUND).lines
        cluster.scrapes.clear()
        cluster.run(120)
        changes = cluster.changes()
        assert len(changes) >= 2 and per_ffn(changes[1][1]) < per_ffn(changes[0][1])
        times = [first] + [when for when, _ in changes[1:]]
        assert all(later - earlier >= 1800 for earlier, later in zip(times, times[1:]))

    def test_min_available_holds_a_change_that_no_surge_could_make_safely(self):
        cluster = attention_bound(ratio=ratio("Auto", cooldownSeconds=0)).run(12)  # 1 group, no surge
        assert cluster.changes() == [] and "minAvailable" in cluster.ratio["reason"]

    def test_min_available_is_kept_during_the_change(self):
        cluster = attention_bound(replicas=3, rollout={"maxUnavailable": 2},
                          ratio=ratio("Auto", minAvailable=2, cooldownSeconds=0)).run(30)
        assert len(cluster.changes()) == 1
        started = cluster.changes()[0][0]
        assert min(ready for when, _, ready in cluster.history if when >= started) >= 2

    def test_editing_the_ranks_or_leaving_auto_returns_to_the_spec(self):
        cluster = attention_bound(rollout={"maxSurge": 1}, ratio=ratio("Auto", cooldownSeconds=0))
        while not cluster.changes():
            cluster.tick()
        assert effective_spec(parse_spec(cluster.body["spec"]), cluster.status).topology != Topology(1, 1)
        cluster.body["spec"]["ratio"]["mode"] = "Advise"
        assert effective_spec(parse_spec(cluster.body["spec"]), cluster.status).topology == Topology(1, 1)
        cluster.body["spec"]["ratio"]["mode"] = "Auto"
        cluster.body["spec"]["attention"]["ranks"] = 3
        assert effective_spec(parse_spec(cluster.body["spec"]), cluster.status).topology == Topology(3, 1)


def test_the_rollout_budget_under_auto_keeps_min_available():
    spec = parse_spec(make_cr(replicas=4, ratio={"mode": "Auto", "minAvailable": 3})["spec"])
    assert max_unavailable(spec.ratio, 4, 2, 0) == 1
    assert max_unavailable(spec.ratio, 3, 1, 0) == 1  # no surge: clamping to 0 would stall it
    assert max_unavailable(spec.ratio, 3, 1, 1) == 0
    off = parse_spec(make_cr()["spec"]).ratio
    assert max_unavailable(off, 4, 2, 0) == 2


def test_without_new_samples_nothing_is_re_evaluated():
    spec = parse_spec(make_cr(ratio={"mode": "Auto"})["spec"])
    previous = {"mode": "Auto", "current": "2A1F", "recommended": "3A1F", "streak": 1,
                "lastSampleTime": "2027-01-15T08:00:00Z"}
    outcome = decide(spec, Topology(2, 1), {}, previous, Fleet(1, 1, True, 1, 0), T0)
    assert outcome.status == previous and outcome.events == []


def test_near_the_threshold_noise_changes_the_topology_at_most_once_per_cool_down():
    """2A1F with these costs: 5A1F predicts about +16 %, just above minGainPercent 15, so noise
    flips the recommendation on and off."""
    cluster = Cluster(ATTENTION_BOUND, noise=0.1, replicas=2, rollout={"maxSurge": 1},
                      ratio=ratio("Auto", cooldownSeconds=900)).run(80)
    times = [when for when, _ in cluster.changes()]
    assert all(later - earlier >= 900 for earlier, later in zip(times, times[1:]))
    assert len(cluster.events("RatioChanged")) == len(times) <= 3
    shapes = ["2A1F"] + [topology for _, topology in cluster.changes()]
    assert len(set(shapes)) == len(shapes)  # never back to an earlier shape


def test_what_no_longer_applies_is_written_as_null_for_the_merge_patch():
    cluster = attention_bound(ratio=ratio("Advise")).run(8)
    assert cluster.ratio["recommended"] == "5A1F"
    cluster.body["spec"]["ratio"]["mode"] = "Off"
    cluster.tick()
    assert "ratio" in cluster.status and cluster.status["ratio"] is None  # null removes status.ratio
    cluster.tick()
    assert "ratio" not in cluster.status


def test_autos_groups_are_the_groups_the_same_ranks_written_by_hand_give():
    spec = parse_spec(make_cr(ratio={"mode": "Auto"})["spec"])
    status = {"ratio": {"appliedTopology": "4A1F", "basedOn": "2A1F"}}
    by_hand = parse_spec(make_cr(attention={"ranks": 4}, ratio={"mode": "Auto"})["spec"])
    assert effective_spec(spec, status).revision == by_hand.revision != spec.revision
    outside = {"ratio": {"appliedTopology": "12A1F", "basedOn": "2A1F"}}  # beyond maxAttentionPerFFN 8
    assert effective_spec(spec, outside) is spec
