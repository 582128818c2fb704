"""The planner, by simulating whole rollouts and restarts step by step.

A tiny fake cluster applies each plan the way the reconciler does (replace = new
template + all pods deleted; StatefulSets recreate pods from their template, Pending
first, Ready one step later) and the invariants are checked after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from afd_operator.groups.plan import RECREATE, Desired, GroupState, plan_groups, restart_delay

SIZE = 3  # pods per group (e.g. 2 attention + 1 FFN)


@dataclass
class FakeGroup:
    template: str
    pods: list = field(default_factory=list)  # [revision, "Pending" | "Ready"]
    lost: bool = False
    restarts: int = 0
    last_restart: float | None = None
    failed: bool = False

    @property
    def ready(self) -> bool:
        return len(self.pods) == SIZE and all(state == "Ready" for _, state in self.pods)


class FakeCluster:
    def __init__(self, n: int, revision: str) -> None:
        self.groups = {i: FakeGroup(revision, [[revision, "Ready"]] * SIZE) for i in range(n)}
        self.log: list[str] = []

    def states(self) -> list[GroupState]:
        return [
            GroupState(i, g.template, ready=g.ready and not g.lost,
                       pending=any(s == "Pending" for _, s in g.pods), lost=g.lost, failed=g.failed,
                       restarts=g.restarts, last_restart=g.last_restart)
            for i, g in self.groups.items()
        ]

    def apply(self, plan, now: float) -> None:
        for a in plan.actions:
            self.log.append(f"{a.kind}:{a.index}")
            if a.kind == "create":
                assert a.index not in self.groups, "create must use a free index"
                self.groups[a.index] = FakeGroup(a.revision)
            elif a.kind == "replace":
                self.groups[a.index] = FakeGroup(a.revision)
            elif a.kind == "restart":
                g = self.groups[a.index]
                g.pods, g.lost, g.restarts, g.last_restart = [], False, g.restarts + 1, now
            elif a.kind == "delete":
                del self.groups[a.index]
            elif a.kind == "fail":
                self.groups[a.index].failed = True

    def kubelet(self) -> None:
        """StatefulSets recreate missing pods from the template; Pending pods turn Ready."""
        for g in self.groups.values():
            g.pods = [[rev, "Ready"] for rev, _ in g.pods]
            g.pods += [[g.template, "Pending"]] * (SIZE - len(g.pods))

    def ready_count(self) -> int:
        return sum(g.ready and not g.lost for g in self.groups.values())


def simulate(cluster: FakeCluster, desired: Desired, steps: int = 60):
    """Run plan/apply/kubelet until nothing is left to do; check invariants at every step."""
    floor = desired.replicas - desired.max_unavailable
    for step in range(steps):
        ready_before = cluster.ready_count()
        plan = plan_groups(desired, cluster.states(), now=float(step))
        cluster.apply(plan, now=float(step))
        for index, g in cluster.groups.items():
            assert len({rev for rev, _ in g.pods}) <= 1, f"step {step}: group {index} mixes revisions"
        assert len(cluster.groups) <= desired.replicas + desired.max_surge, f"step {step}: surge exceeded"
        # Never take Ready groups below the floor (a scale-up may start below it).
        assert cluster.ready_count() >= min(floor, ready_before), f"step {step}: below the floor {floor}"
        if not plan.actions and all(g.ready for g in cluster.groups.values()):
            return step
        cluster.kubelet()
    pytest.fail(f"no convergence in {steps} steps: {cluster.log}")


@pytest.mark.parametrize("n, surge, unavailable", [(3, 0, 1), (3, 1, 0), (4, 1, 1), (2, 2, 0), (5, 0, 2), (1, 0, 1), (1, 1, 0)])
def test_rollout_replaces_whole_groups_within_bounds(n, surge, unavailable):
    cluster = FakeCluster(n, "a")
    simulate(cluster, Desired(n, "b", max_surge=surge, max_unavailable=unavailable))
    assert len(cluster.groups) == n
    assert all(g.template == "b" and g.ready for g in cluster.groups.values())
    # Each old group left exactly once (replaced in place, or deleted for a surge group).
    assert sum(entry.startswith(("replace", "delete")) for entry in cluster.log) == n


def test_surge_rollout_never_drops_below_the_replica_count():
    cluster = FakeCluster(3, "a")
    simulate(cluster, Desired(3, "b", max_surge=1, max_unavailable=0))
    assert cluster.log.count("create:3") == 1  # the surge group took a fresh index
    assert all(not entry.startswith("replace") for entry in cluster.log)


def test_partition_keeps_low_groups_on_the_old_revision():
    cluster = FakeCluster(4, "a")
    simulate(cluster, Desired(4, "b", partition=2))
    assert {i: g.template for i, g in cluster.groups.items()} == {0: "a", 1: "a", 2: "b", 3: "b"}


def test_scale_up_and_down():
    cluster = FakeCluster(1, "a")
    simulate(cluster, Desired(3, "a"))
    assert sorted(cluster.groups) == [0, 1, 2]
    simulate(cluster, Desired(1, "a"))
    assert sorted(cluster.groups) == [0]  # highest indices go first


def test_scale_down_during_a_rollout_prefers_old_groups():
    cluster = FakeCluster(4, "a")
    cluster.apply(plan_groups(Desired(4, "b", max_unavailable=1), cluster.states(), 0.0), 0.0)
    cluster.kubelet()
    cluster.kubelet()
    plan = plan_groups(Desired(2, "b", max_unavailable=1), cluster.states(), 1.0)
    deleted = [a.index for a in plan.actions if a.kind == "delete"]
    assert len(deleted) == 2 and all(cluster.groups[i].template == "a" for i in deleted)


def test_broken_old_groups_are_replaced_without_spending_the_budget():
    cluster = FakeCluster(3, "a")
    cluster.groups[0].pods = [["a", "Ready"], ["a", "Ready"]]  # a rank is missing
    # Two Ready groups are exactly the floor (3 - 1): no Ready group may go, the broken one may.
    plan = plan_groups(Desired(3, "b", max_unavailable=1), cluster.states(), 0.0)
    assert [(a.kind, a.index) for a in plan.actions] == [("replace", 0)]
    cluster.groups[0] = FakeGroup("a", [["a", "Ready"]] * SIZE)
    plan = plan_groups(Desired(3, "b", max_unavailable=1), cluster.states(), 0.0)
    assert [(a.kind, a.index) for a in plan.actions] == [("replace", 2)]  # healthy: one at a time


class TestRestarts:
    DESIRED = Desired(1, "a", restart_type=RECREATE, backoff_seconds=30, max_backoff_seconds=120)

    def lose(self, cluster):
        g = cluster.groups[0]
        g.lost = True
        g.pods = [["a", "Ready"]] * SIZE

    def test_backoff_doubles_from_an_immediate_first_restart_up_to_the_cap(self):
        cluster = FakeCluster(1, "a")
        restarts_at = []
        now = 0.0
        while now < 1000 and len(restarts_at) < 6:
            if not cluster.groups[0].lost and cluster.groups[0].ready:
                self.lose(cluster)  # the rank dies again as soon as the group is back
            plan = plan_groups(self.DESIRED, cluster.states(), now)
            if any(a.kind == "restart" for a in plan.actions):
                restarts_at.append(now)
            cluster.apply(plan, now)
            cluster.kubelet()
            now += 1
        gaps = [b - a for a, b in zip(restarts_at, restarts_at[1:])]
        assert restarts_at[0] == 0  # the first restart is immediate
        assert gaps == [30, 60, 120, 120, 120]

    def test_a_pending_pod_never_triggers_a_restart(self):
        cluster = FakeCluster(1, "a")
        self.lose(cluster)
        cluster.groups[0].pods[0] = ["a", "Pending"]  # e.g. the replacement pod is pulling its image
        for now in range(100):
            assert not plan_groups(self.DESIRED, cluster.states(), float(now)).actions

    def test_budget_marks_the_group_failed_and_stops_restarting(self):
        desired = Desired(1, "a", restart_type=RECREATE, backoff_seconds=0, max_backoff_seconds=0, max_restarts=2)
        cluster = FakeCluster(1, "a")
        kinds = []
        for now in range(20):
            if cluster.groups[0].ready and not cluster.groups[0].lost:
                self.lose(cluster)
            plan = plan_groups(desired, cluster.states(), float(now))
            kinds += [a.kind for a in plan.actions]
            cluster.apply(plan, float(now))
            cluster.kubelet()
        assert kinds == ["restart", "restart", "fail"]
        assert cluster.groups[0].failed

    def test_policy_none_leaves_recovery_to_the_runtime(self):
        cluster = FakeCluster(1, "a")
        self.lose(cluster)
        assert not plan_groups(Desired(1, "a", restart_type="None"), cluster.states(), 0.0).actions

    def test_waiting_groups_report_the_remaining_backoff(self):
        state = GroupState(0, "a", lost=True, restarts=2, last_restart=100.0)
        plan = plan_groups(self.DESIRED, [state], now=110.0)
        assert plan.actions == () and plan.waiting == {0: 50.0}


def test_restart_delay():
    assert [restart_delay(k, 30, 600) for k in range(7)] == [0, 30, 60, 120, 240, 480, 600]
