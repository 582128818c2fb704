"""Observation, status and the reconciler with a fake store: the rules that keep a group
consistent and the status honest, without any API server."""

from __future__ import annotations

import yaml

from afd_operator.model import labels as L
from afd_operator.apiserver import PLURALS
from afd_operator.model.spec import parse_spec
from afd_operator.groups.observe import GroupMemory, PodFacts, format_time, observe_groups, pod_facts, remember
from afd_operator.reconcile.deployment import reconcile
from afd_operator.reconcile.status import merge_conditions, Condition
from op_testkit import ROOT, FakeStore, make_cr

NOW = 1_800_000_000.0


def pod(name, group=0, role="attention", revision="r1", ready=True, phase="Running", restarts=0, created=NOW - 100):
    return PodFacts(name, group, role, revision, phase, ready, restarts, created)


def ready_pods(revision, group=0, created=NOW - 100):
    return [pod(f"demo-g{group}-attn-{r}", group, "attention", revision, created=created) for r in range(2)] + [
        pod(f"demo-g{group}-ffn-0", group, "ffn", revision, created=created)]


def status_with(groups, **extra):
    return {"groups": [{"index": i, "revision": rev, "phase": "Ready", "readySince": format_time(NOW - 50),
                        "restarts": 0, "restartBaseline": 0} for i, rev in groups], **extra}


class TestObservation:
    def test_pod_facts_reads_labels_readiness_and_restarts(self):
        body = {"metadata": {"name": "demo-g1-ffn-0", "labels": {L.NAME: "demo", L.GROUP: "1", L.ROLE: "ffn",
                                                                  L.REVISION: "r1"},
                             "creationTimestamp": "2026-01-01T00:00:00Z"},
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                           "containerStatuses": [{"restartCount": 2}, {"restartCount": 1}]}}
        facts = pod_facts(body)
        assert (facts.group, facts.role, facts.ready, facts.restarts) == (1, "ffn", True, 3)
        assert pod_facts({"metadata": {"labels": {"app": "other"}}}) is None

    def test_a_rank_is_lost_only_after_the_group_was_ready(self):
        memory = GroupMemory(0, "r1")
        [view] = observe_groups([memory], ready_pods("r1")[:2], 2, 1)  # FFN pod missing, never Ready
        assert not view.state.lost
        [view] = observe_groups([GroupMemory(0, "r1", ready_since=NOW - 50)], ready_pods("r1")[:2], 2, 1)
        assert view.state.lost and "missing" in view.lost_reason

    def test_recreated_pods_and_container_restarts_count_as_lost(self):
        memory = GroupMemory(0, "r1", ready_since=NOW - 50, restart_baseline=1)
        pods = ready_pods("r1")
        pods[2] = pod("demo-g0-ffn-0", role="ffn", created=NOW - 10)
        [view] = observe_groups([memory], pods, 2, 1)
        assert "recreated" in view.lost_reason
        pods = ready_pods("r1")
        pods[0] = pod("demo-g0-attn-0", restarts=2)
        [view] = observe_groups([memory], pods, 2, 1)
        assert "1 container restart(s)" in view.lost_reason

    def test_mixed_revisions_are_never_ready(self):
        pods = ready_pods("r1")
        pods[0] = pod("demo-g0-attn-0", revision="r0")
        [view] = observe_groups([GroupMemory(0, "r1")], pods, 2, 1)
        assert not view.state.ready

    def test_groups_known_only_from_pods_are_adopted(self):
        [view] = observe_groups([], ready_pods("r7", group=3), 2, 1)
        assert (view.state.index, view.state.revision, view.state.ready) == (3, "r7", True)

    def test_a_deleted_groups_stopping_pods_are_not_adopted_again(self):
        """After a scale-down the group's pods run their preStop drain for seconds: not a group."""
        from dataclasses import replace
        stopping = [replace(p, deleting=True) for p in ready_pods("r7", group=1)]
        assert observe_groups([], stopping, 2, 1) == []
        [view] = observe_groups([], stopping[:2] + ready_pods("r7", group=1)[2:], 2, 1)  # one pod still live
        assert view.state.index == 1

    def test_runtime_recovery_rebaselines_when_the_policy_leaves_it_to_the_runtime(self):
        memory = GroupMemory(0, "r1", ready_since=NOW - 50)
        pods = ready_pods("r1")
        pods[2] = pod("demo-g0-ffn-0", role="ffn", created=NOW - 10)  # the FFN came back by itself
        [view] = observe_groups([memory], pods, 2, 1)
        assert remember(view, NOW, 600, runtime_recovers=True).ready_since == NOW
        assert remember(view, NOW, 600, runtime_recovers=False).ready_since == NOW - 50


def test_conditions_keep_their_transition_time_until_they_flip():
    first = merge_conditions([], [Condition("Ready", False, "Starting")], 1, NOW)
    same = merge_conditions(first, [Condition("Ready", False, "GroupsNotReady")], 2, NOW + 60)
    assert same[0]["lastTransitionTime"] == first[0]["lastTransitionTime"]
    flipped = merge_conditions(same, [Condition("Ready", True, "AllGroupsReady")], 2, NOW + 120)
    assert flipped[0]["lastTransitionTime"] == format_time(NOW + 120)


class TestReconcile:
    def test_first_reconcile_creates_group_objects_services_first(self):
        store = FakeStore()
        outcome = reconcile(make_cr(), [], store, NOW)
        kinds = [k for k, _, _ in store.applied]
        assert kinds == ["ConfigMap", "Service", "Service", "StatefulSet", "StatefulSet", "Service"]
        assert outcome.status["groups"][0]["phase"] == "Creating"
        assert [(c["type"], c["status"]) for c in outcome.status["conditions"]] == [
            ("Ready", "False"), ("Available", "False"), ("Progressing", "True"), ("Degraded", "False"),
            ("Failed", "False")]
        assert ("Normal", "GroupCreated") in [(t, r) for t, r, _ in
                                               [(e.type, e.reason, e.message) for e in outcome.events]]

    def test_never_ready_while_an_old_revision_serves(self):
        body = make_cr(replicas=2, rollout={"maxSurge": 1, "maxUnavailable": 0})
        new = parse_spec(body["spec"]).revision
        body["status"] = status_with([(0, "old"), (1, new)])  # every rank Ready, one group still old
        outcome = reconcile(body, ready_pods("old", 0) + ready_pods(new, 1), FakeStore(), NOW)
        assert [(a.kind, a.index) for a in outcome.actions] == [("create", 2)]  # surge first
        ready = next(c for c in outcome.status["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "RolloutInProgress")
        assert outcome.status["currentRevision"] == "old" and outcome.status["updateRevision"] == new

    def test_replace_applies_the_new_revision_then_deletes_every_rank(self):
        body = make_cr(replicas=1)
        new = parse_spec(body["spec"]).revision
        body["status"] = status_with([(0, "old")])
        store = FakeStore()
        reconcile(body, ready_pods("old"), store, NOW)
        assert {rev for _, _, rev in store.applied if rev} == {new}
        assert sorted(store.deleted) == [("Pod", "demo-g0-attn-0"), ("Pod", "demo-g0-attn-1"), ("Pod", "demo-g0-ffn-0")]

    def test_a_full_reconcile_never_reapplies_groups_at_an_old_revision(self):
        """Their StatefulSets must keep the old template, or a recreated rank would mix revisions."""
        body = make_cr(replicas=2, rollout={"maxUnavailable": 0, "maxSurge": 1})
        new = parse_spec(body["spec"]).revision
        body["status"] = status_with([(0, "old"), (1, new)])
        store = FakeStore()
        reconcile(body, ready_pods("old", 0) + ready_pods(new, 1), store, NOW, full=True)
        touched = {name for _, name, _ in store.applied}
        assert "demo-g1-attn" in touched and not any(name.startswith("demo-g0-") for name in touched)

    def test_an_invalid_spec_applies_nothing_and_says_why_once(self):
        store = FakeStore()
        body = make_cr(attention={"ranks": 1}, ffn={"ranks": 2})
        outcome = reconcile(body, [], store, NOW)
        assert store.applied == [] and store.deleted == []
        degraded = next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")
        assert degraded["reason"] == "InvalidSpec" and "ffn.ranks (2) must not exceed attention.ranks (1)" in degraded["message"]
        assert [e.reason for e in outcome.events] == ["InvalidSpec"]
        body["status"] = outcome.status
        assert reconcile(body, [], store, NOW + 10).events == []

    def test_disabled_optional_objects_are_pruned_on_full_reconciles(self):
        store = FakeStore()
        reconcile(make_cr(), [], store, NOW, full=True)
        assert ("PodDisruptionBudget", "demo") in store.deleted and ("PodMonitor", "demo") in store.deleted


def test_rbac_covers_every_kind_the_operator_writes():
    rules = [r for doc in yaml.safe_load_all((ROOT / "operator/afd_operator/rbac.yaml").read_text())
             if doc["metadata"]["name"] == "afd-operator" for r in doc["rules"]]
    granted = {(g, res, v) for r in rules for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]}
    assert not any("*" in x for x in granted)
    groups = {"ConfigMap": [""], "Service": [""], "Pod": [""], "Event": [""], "StatefulSet": ["apps"],
              "Deployment": ["apps"], "PodDisruptionBudget": ["policy"], "PodMonitor": ["monitoring.coreos.com"],
              "PodGroup": ["scheduling.volcano.sh", "scheduling.x-k8s.io"], "AFDDeployment": ["afd.io"],
              "Secret": [""], "NetworkPolicy": ["networking.k8s.io"]}
    needed = {"Pod": ["delete", "list", "watch"], "Event": ["create"], "AFDDeployment": ["list", "watch", "patch"],
              "Secret": ["get", "create", "patch"], "Deployment": ["get", "create", "patch", "delete"]}
    for kind, plural in PLURALS.items():
        for group in groups[kind]:
            for verb in needed.get(kind, ["create", "patch", "delete"]):
                assert (group, plural, verb) in granted, f"{verb} {group}/{plural} missing from rbac.yaml"
    assert ("afd.io", "afddeployments/status", "patch") in granted


class TestGroupSecret:
    """Created once with a random value, never rotated, adopted only when it is ours."""

    KEY = ("Secret", "ns", "demo-group-secret")

    def value(self, store):
        import base64
        return base64.b64decode(store.objects[self.KEY]["data"]["group-secret"]).decode()

    def test_created_once_with_32_random_bytes_and_never_rotated(self):
        store = FakeStore()
        first = reconcile(make_cr(), [], store, NOW)
        value = self.value(store)
        assert len(bytes.fromhex(value)) == 32
        secret = store.objects[self.KEY]
        assert secret["immutable"] and secret["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
        body = make_cr()
        body["status"] = first.status
        for step in range(3):
            reconcile(body, ready_pods(first.status["updateRevision"]), store, NOW + step, full=True)
        assert self.value(store) == value and store.patches == []
        other = FakeStore()
        reconcile(make_cr(), [], other, NOW)
        assert self.value(other) != value  # random per resource, not derived from the spec

    def test_its_value_never_reaches_status_or_events(self):
        store = FakeStore()
        outcome = reconcile(make_cr(), [], store, NOW)
        assert self.value(store) not in repr(outcome) + repr(store.applied)

    def test_a_leftover_of_an_earlier_resource_of_the_same_name_is_adopted_not_replaced(self):
        store = FakeStore()
        reconcile(make_cr(uid="uid-old"), [], store, NOW)
        value = self.value(store)
        outcome = reconcile(make_cr(uid="uid-new"), [], store, NOW + 1)
        assert self.value(store) == value
        [(kind, name, patch)] = store.patches
        assert patch["metadata"]["ownerReferences"][0]["uid"] == "uid-new"
        assert next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")["status"] == "False"

    def test_a_foreign_secret_of_that_name_is_reported_and_left_alone(self):
        store = FakeStore()
        store.objects[self.KEY] = {"metadata": {"name": "demo-group-secret", "labels": {"app": "mine"}},
                                   "data": {"group-secret": "c2VjcmV0"}}
        outcome = reconcile(make_cr(), [], store, NOW)
        degraded = next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and "not made by afd-operator" in degraded["message"]
        assert store.patches == [] and store.objects[self.KEY]["data"] == {"group-secret": "c2VjcmV0"}

    def test_a_secret_deleted_under_running_groups_is_recreated_with_a_warning(self):
        store = FakeStore()
        body = make_cr()
        body["status"] = status_with([(0, parse_spec(body["spec"]).revision)])
        outcome = reconcile(body, ready_pods(parse_spec(body["spec"]).revision), store, NOW)
        assert self.KEY in store.objects
        [warning] = [e for e in outcome.events if e.reason == "GroupSecretRecreated"]
        assert warning.type == "Warning" and "restarted" in warning.message


def test_an_nccl_group_that_lost_a_rank_is_left_to_the_runtime_by_default():
    """Issue 38: its attention ranks hold their requests while the pair is rebuilt; a restart would end them."""
    body = make_cr(afd={"connector": "nccl"})
    revision = parse_spec(body["spec"]).revision
    body["status"] = status_with([(0, revision)])
    store = FakeStore()
    outcome = reconcile(body, ready_pods(revision)[:2], store, NOW)  # the FFN rank is gone
    assert outcome.actions == () and not [d for d in store.deleted if d[0] == "Pod"]
    group = outcome.status["groups"][0]
    assert group["phase"] == "Degraded" and "waiting for the runtime to reconnect" in group["message"]
    body = make_cr(afd={"connector": "nccl"}, restartPolicy={"type": "RecreateGroupOnRankFailure"})
    body["status"] = status_with([(0, revision)])
    assert [a.kind for a in reconcile(body, ready_pods(revision)[:2], FakeStore(), NOW).actions] == ["restart"]


def test_a_failed_group_sets_the_failed_condition():
    body = make_cr(afd={"connector": "nccl"}, restartPolicy={"type": "RecreateGroupOnRankFailure", "maxRestarts": 1, "backoffSeconds": 0})
    revision = parse_spec(body["spec"]).revision
    body["status"] = status_with([(0, revision)])
    body["status"]["groups"][0]["restarts"] = 1
    pods = ready_pods(revision)[:2]  # the FFN rank is gone again
    store = FakeStore()
    outcome = reconcile(body, pods, store, NOW)
    assert [a.kind for a in outcome.actions] == ["fail"] and not [d for d in store.deleted if d[0] == "Pod"]
    failed = next(c for c in outcome.status["conditions"] if c["type"] == "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "RestartBudgetExhausted")
    assert "group(s) 0" in failed["message"] and "maxRestarts (1)" in failed["message"]
    assert outcome.status["groups"][0]["phase"] == "Failed"
    body["status"] = outcome.status  # it stays Failed, and nothing restarts it
    again = reconcile(body, pods, store, NOW + 100)
    assert again.actions == () and next(c for c in again.status["conditions"] if c["type"] == "Failed")["status"] == "True"


def test_disabled_network_policies_are_pruned_and_enabled_ones_applied():
    body = make_cr()
    revision = parse_spec(body["spec"]).revision
    body["status"] = status_with([(0, revision)])
    store = FakeStore()
    reconcile(body, ready_pods(revision), store, NOW, full=True)
    assert {("NetworkPolicy", "demo-g0-attn"), ("NetworkPolicy", "demo-g0-ffn")} <= set(store.deleted)
    body = make_cr(networkPolicy={"enabled": True})
    body["status"] = status_with([(0, revision)])
    store = FakeStore()
    reconcile(body, ready_pods(revision), store, NOW, full=True)
    assert [n for k, n, _ in store.applied if k == "NetworkPolicy"] == ["demo-g0-attn", "demo-g0-ffn"]
    assert not [d for d in store.deleted if d[0] == "NetworkPolicy"]
