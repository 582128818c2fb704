"""spec.autoscaling through the reconciler (fake store): the count it plans, the status and
Events, and the three-step leave of a group (drain, wait for its requests, delete)."""

from __future__ import annotations

from dataclasses import replace

from afd_operator.model.spec import parse_spec
from afd_operator.groups.observe import PodFacts, format_time
from afd_operator.groups.plan import Desired, GroupState, plan_groups
from afd_operator.reconcile.deployment import reconcile
from afd_operator.autoscaler.signals import ServiceSample
from op_testkit import FakeStore, make_cr

NOW = 1_800_000_000.0
INF = float("inf")
AUTOSCALING = {"enabled": True, "minGroups": 1, "maxGroups": 3, "targets": {"ttftP90Seconds": 1.0},
               "scaleUpWindowSeconds": 30, "scaleDownWindowSeconds": 30, "cooldownSeconds": 0,
               "drainTimeoutSeconds": 300}


def revision():
    return parse_spec(make_cr(autoscaling=AUTOSCALING)["spec"]).revision


def pods(group, ready=True, ip="10.0.0.1"):
    rev = revision()
    return [PodFacts(f"demo-g{group}-attn-{r}", group, "attention", rev, "Running", ready, 0, NOW - 500, ip=ip)
            for r in range(2)] + [PodFacts(f"demo-g{group}-ffn-0", group, "ffn", rev, "Running", True, 0, NOW - 500, ip=ip)]


def sample(at, slow=0.0, in_flight=0.0):
    """A group's attention ranks: 10 first tokens per interval, `slow` of them between 1 and 2 s."""
    n = at / 15
    return ServiceSample(at, ((0.5, 10 * n - slow * n), (2.0, 10 * n), (INF, 10 * n)), (), in_flight, 0.0, (0.1, 0.1))


def service(groups, at, slow=0.0, in_flight=0.0):
    return {g: (sample(at - 15, slow, in_flight), sample(at, slow, in_flight)) for g in groups}


def body(groups, autoscaling_status=None, draining=()):
    cr = make_cr(autoscaling=AUTOSCALING)
    cr["status"] = {"groups": [{"index": g, "revision": revision(), "phase": "Ready", "readySince": format_time(NOW - 400),
                                **({"drainingSince": format_time(NOW - 20)} if g in draining else {})} for g in groups],
                    **({"autoscaling": autoscaling_status} if autoscaling_status else {})}
    return cr


def step(cr, pod_list, at, svc):
    store, drained = FakeStore(), []
    outcome = reconcile(cr, pod_list, store, at, service=svc, drain=lambda pod, port: drained.append((pod.name, port)))
    return outcome, store, drained


def test_a_missed_target_for_the_window_adds_a_group_and_says_why():
    cr = body([0])
    for t in (NOW, NOW + 15, NOW + 30):
        outcome, store, _ = step(cr, pods(0), t, service([0], t, slow=3))
        cr["status"] = outcome.status
    state = outcome.status["autoscaling"]
    assert (state["desiredGroups"], state["signal"]) == (2, "ttftP90Seconds")
    assert [a.kind for a in outcome.actions] == ["create"] and outcome.actions[0].index == 1
    assert any(e.reason == "AutoscaleUp" and "ttftP90Seconds" in e.message for e in outcome.events)
    assert outcome.status["groupsReady"] == "1/2"


def test_a_leaving_group_is_drained_first_and_deleted_once_its_requests_are_done():
    cr = body([0, 1], {"desiredGroups": 2})
    everything = pods(0) + pods(1, ip="10.0.0.2")
    for t in (NOW, NOW + 15, NOW + 30):  # quiet for the window: one group would do
        outcome, store, drained = step(cr, everything, t, service([0, 1], t))
        cr["status"] = outcome.status
    # step 1: group 1 is marked draining, its Ready attention ranks are asked to drain, nothing is deleted
    assert outcome.status["autoscaling"]["desiredGroups"] == 1
    [leaving] = [g for g in outcome.status["groups"] if g["index"] == 1]
    assert leaving["phase"] == "Draining" and leaving["drainingSince"] == format_time(NOW + 30)
    assert drained == [("demo-g1-attn-0", 9090), ("demo-g1-attn-1", 9090)]
    assert store.deleted == [] and [e.reason for e in outcome.events if e.reason in ("AutoscaleDown", "GroupDraining", "GroupDeleted")] == [
        "AutoscaleDown", "GroupDraining"]
    # step 2: its ranks are unready now (out of the Service) but still run requests: it stays
    unready = pods(0) + pods(1, ready=False, ip="10.0.0.2")
    busy = service([0], NOW + 45) | {1: (sample(NOW + 30, in_flight=3), sample(NOW + 45, in_flight=3))}
    outcome, store, drained = step(cr, unready, NOW + 45, busy)
    cr["status"] = outcome.status
    assert store.deleted == [] and drained == [] and outcome.status["replicas"] == 2
    assert outcome.status["autoscaling"]["reason"] == "every target met; at minGroups (1)"
    # step 3: nothing left running on it: the group goes
    idle = service([0, 1], NOW + 60)
    outcome, store, _ = step(cr, unready, NOW + 60, idle)
    assert [(a.kind, a.index, a.reason) for a in outcome.actions] == [("delete", 1, "ScaleDown (drained)")]
    assert ("StatefulSet", "demo-g1-attn") in store.deleted and ("StatefulSet", "demo-g0-attn") not in store.deleted
    assert [g["index"] for g in outcome.status["groups"]] == [0]


def test_a_drain_that_outlasts_its_timeout_ends_with_the_deletion():
    cr = body([0, 1], {"desiredGroups": 1}, draining=(1,))
    unready = pods(0) + pods(1, ready=False, ip="10.0.0.2")
    busy = {0: service([0], NOW)[0], 1: (sample(NOW - 15, in_flight=2), sample(NOW, in_flight=2))}
    outcome, store, _ = step(cr, unready, NOW, busy)
    assert store.deleted == []
    outcome, store, _ = step(cr, unready, NOW + 300, busy)
    assert [a.reason for a in outcome.actions] == ["ScaleDown (drain timed out after 320s)"]
    # a rank the operator cannot reach (its drain call fails) stays Ready: the timeout still ends it
    outcome, _, drained = step(cr, pods(0) + pods(1, ip="10.0.0.2"), NOW + 300, busy)
    assert [a.reason for a in outcome.actions] == ["ScaleDown (drain timed out after 320s)"] and drained == []


def test_a_ready_rank_of_a_draining_group_is_asked_again():
    """A rank restarted mid-drain is Ready again: the operator repeats the drain call."""
    cr = body([0, 1], {"desiredGroups": 1}, draining=(1,))
    mixed = pods(0) + [replace(p, ready=p.name != "demo-g1-attn-0") for p in pods(1, ip="10.0.0.2")]
    _, store, drained = step(cr, mixed, NOW, service([0, 1], NOW))
    assert drained == [("demo-g1-attn-1", 9090)] and store.deleted == []


def test_vllm_attention_ranks_have_no_drain_endpoint_so_the_group_goes_at_once():
    cr = body([0, 1], {"desiredGroups": 1}, draining=(1,))
    cr["spec"]["afd"] = {"attentionEngine": "vllm"}
    outcome, store, drained = step(cr, pods(0) + pods(1, ip="10.0.0.2"), NOW, service([0, 1], NOW))
    deletes = [(a.index, a.reason) for a in outcome.actions if a.kind == "delete"]  # (group 0 rolls: a new revision)
    assert drained == [] and deletes == [(1, "ScaleDown (vLLM attention ranks: preStop only)")]


def test_new_groups_never_take_a_draining_groups_index():
    plan = plan_groups(Desired(replicas=2, revision="r", reserved=frozenset({1})), [GroupState(0, "r", ready=True)], NOW)
    assert [(a.kind, a.index) for a in plan.actions] == [("create", 2)]


def test_turning_autoscaling_off_removes_its_status_and_spec_replicas_rules_again():
    cr = body([0], {"desiredGroups": 1})
    cr["spec"]["autoscaling"] = {"enabled": False}
    cr["spec"]["replicas"] = 2
    outcome, _, _ = step(cr, pods(0), NOW, {})
    assert outcome.status["autoscaling"] is None
    assert [a.kind for a in outcome.actions] == ["create"]


def test_a_broken_group_leaves_first_and_does_not_hold_the_autoscaler():
    """Group 0 lost its FFN after being Ready: it is not warming (the autoscaler decides) and it is
    the one that goes when the load fits in fewer groups."""
    cr = body([0, 1], {"desiredGroups": 2})
    broken = [replace(p, ready=p.role != "ffn") for p in pods(0)]
    everything = broken + pods(1, ip="10.0.0.2")
    for t in (NOW, NOW + 15, NOW + 30):
        outcome, _, _ = step(cr, everything, t, service([1], t))
        cr["status"] = outcome.status
    assert outcome.status["autoscaling"]["desiredGroups"] == 1
    assert [g["index"] for g in outcome.status["groups"] if g.get("drainingSince")] == [0]
