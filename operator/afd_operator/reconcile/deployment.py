"""Reconcile one AFDDeployment: parse → observe → plan → apply → status.

The only side effects go through a `Store`; the status is returned for the caller
(the kopf handler) to write, so there is one writer of status. Groups that are not at
the update revision are never re-applied: their StatefulSets must keep recreating lost
ranks from the old template, or a group would mix revisions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Optional

from afd_operator.model import labels as L
from afd_operator.apiserver import Store
from afd_operator.model.spec import AFDDeploymentSpec, Owner, SpecError, parse_owner, parse_spec
from afd_operator.groups.observe import GroupMemory, GroupView, PodFacts, observe_groups, remember
from afd_operator.autoscaler.step import History, scale_step
from afd_operator.groups.plan import RECREATE, Action, Desired, Plan, plan_groups
from afd_operator.ratio.recommend import Fleet, Scrapes, decide, effective_spec, max_unavailable
from afd_operator.rendering.children import optional_shared_kinds, render_group, render_shared, unwanted_group_objects
from afd_operator.reconcile.router import reconcile_router
from afd_operator.reconcile.secret import ensure_group_secret
from afd_operator.reconcile.status import (
    GroupReport, StatusInput, invalid_spec_conditions, memories_from_status, merge_conditions,
    render_status, transitions,
)

log = logging.getLogger(__name__)

_EVENT_OF_ACTION = {
    "create": ("Normal", "GroupCreated"),
    "replace": ("Normal", "GroupReplaced"),
    "delete": ("Normal", "GroupDeleted"),
    "restart": ("Warning", "GroupRestarted"),
    "fail": ("Warning", "GroupFailed"),
}


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Outcome:
    """What one reconcile decided: the new status, events to post, the actions taken."""

    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    actions: tuple[Action, ...] = ()


def desired_of(spec: AFDDeploymentSpec) -> Desired:
    r = spec.restart_policy
    return Desired(
        replicas=spec.replicas,
        revision=spec.revision,
        max_surge=spec.rollout.max_surge,
        max_unavailable=max_unavailable(spec.ratio, spec.replicas, spec.rollout.max_unavailable, spec.rollout.max_surge),
        partition=spec.rollout.partition,
        restart_type=spec.restart_type,
        backoff_seconds=r.backoff_seconds,
        max_backoff_seconds=r.max_backoff_seconds,
        max_restarts=r.max_restarts,
    )


def reconcile(
    body: Mapping[str, Any], pods: Iterable[PodFacts], store: Store, now: float, full: bool = False,
    scrapes: Optional[Mapping[int, Scrapes]] = None, service: Optional[Mapping[int, History]] = None,
    drain: Optional[Callable[[PodFacts, int], None]] = None,
) -> Outcome:
    """One reconcile step. `full` re-applies every current-revision group (after a spec
    change or an operator restart) and prunes optional objects the spec no longer wants.
    `scrapes`: recent metric scrapes per group, for spec.ratio (oldest first); `service`: each
    group's last two serving samples, for spec.autoscaling; `drain(pod, metrics port)` asks an
    attention rank of a leaving group to stop taking requests."""
    previous = body.get("status") or {}
    generation = body.get("metadata", {}).get("generation")
    try:
        owner = parse_owner(body)
        asked = parse_spec(body.get("spec"))
    except SpecError as err:
        return _invalid(str(err), previous, generation, now)
    spec = effective_spec(asked, previous)  # the ranks spec.ratio Auto chose, if any
    pods = list(pods)
    views = observe_groups(memories_from_status(previous), pods, spec.pods("attention"), spec.pods("ffn"),
                           spec.ffn.expert_parallel)
    reset_after = float(spec.restart_policy.max_backoff_seconds)
    recovers = spec.restart_type != RECREATE
    memories = {v.state.index: _shaped(remember(v, now, reset_after, recovers), spec) for v in views}
    states = [replace(v.state, restarts=memories[v.state.index].restarts) for v in views]
    scaling = scale_step(spec, views, memories, states, pods, service or {}, previous.get("autoscaling") or {}, now)
    spec, memories = scaling.spec, scaling.memories  # spec.replicas: the autoscaler's count when it is on
    plan = plan_groups(replace(desired_of(spec), reserved=scaling.reserved), scaling.planned, now)
    plan = replace(plan, actions=plan.actions + tuple(scaling.deletes))

    secret = ensure_group_secret(store, owner)  # before any pod can be created
    router = reconcile_router(spec, owner, store, full)
    _apply(plan, spec, owner, views, store, full, router.serving)
    for pod in scaling.drain_pods if drain is not None else ():
        drain(pod, spec.ports.metrics)
    reports, problems = _report(spec, views, memories, plan, now)
    problems += [secret.problem] if secret.problem else []
    status = render_status(StatusInput(spec, owner.name, generation, reports, problems), previous, now)
    events = [_action_event(a, views) for a in plan.actions]
    ratio = decide(asked, spec.topology, scrapes or {}, previous.get("ratio") or {}, _fleet(spec, status), now)
    if ratio.status is not None or previous.get("ratio"):
        status["ratio"] = ratio.status  # None: merge-patched as null, which removes it
    events += [Event(*e) for e in ratio.events]
    if router.status is not None or previous.get("router"):
        status["router"] = router.status  # None: merge-patched as null, which removes it
    if scaling.status is not None or previous.get("autoscaling"):
        status["autoscaling"] = scaling.status  # None: merge-patched as null, which removes it
    events += [Event(*e) for e in scaling.events]
    if secret.created and previous.get("groups"):
        events.append(Event("Warning", "GroupSecretRecreated", (
            "the group Secret was missing and has been created with a new value; ranks started "
            "before hold the old one and cannot rejoin their group until it is restarted")))
    events += _condition_events(previous.get("conditions") or [], status["conditions"])
    return Outcome(status, events, plan.actions)


def _apply(plan: Plan, spec: AFDDeploymentSpec, owner: Owner, views: list[GroupView],
           store: Store, full: bool, to_router: bool = False) -> None:
    pods_of = {v.state.index: v for v in views}
    acted = {a.index for a in plan.actions}
    for action in plan.actions:
        if action.kind in ("create", "replace"):
            for obj in render_group(spec, owner, action.index, spec.revision):
                store.apply(obj)
        if action.kind in ("replace", "restart"):
            # All ranks at once: the StatefulSets recreate them together, from one template.
            view = pods_of.get(action.index)
            for pod in sorted(set(view.pod_names if view else ()) | set(_rank_pods(spec, owner, action.index))):
                store.delete("v1", "Pod", owner.namespace, pod)
        if action.kind == "delete":
            for obj in reversed(render_group(spec, owner, action.index, spec.revision)):
                store.delete(obj["apiVersion"], obj["kind"], owner.namespace, obj["metadata"]["name"])
    if full:
        for v in views:
            if v.state.revision == spec.revision and v.state.index not in acted:
                for obj in render_group(spec, owner, v.state.index, spec.revision):
                    store.apply(obj)
            if v.state.revision == spec.revision:
                for api_version, kind, name in unwanted_group_objects(spec, owner, v.state.index):
                    store.delete(api_version, kind, owner.namespace, name)
        for api_version, kind in optional_shared_kinds(spec):
            store.delete(api_version, kind, owner.namespace, owner.name)
    for obj in render_shared(spec, owner, to_router):
        store.apply(obj)


def _shaped(memory: GroupMemory, spec: AFDDeploymentSpec) -> GroupMemory:
    """A group at the update revision has the spec's shape; older ones keep theirs."""
    if memory.revision == spec.revision and memory.topology != str(spec.topology):
        return replace(memory, topology=str(spec.topology))
    return memory


def _fleet(spec: AFDDeploymentSpec, status: Mapping[str, Any]) -> Fleet:
    settled = status["replicas"] == status["updatedReplicas"] == status["availableReplicas"] == spec.replicas
    return Fleet(spec.replicas, status["availableReplicas"], settled, spec.rollout.max_surge,
                 spec.rollout.max_unavailable)


def _rank_pods(spec: AFDDeploymentSpec, owner: Owner, index: int) -> list[str]:
    """Pod names of every rank of a group (pods not yet in the index are deleted too)."""
    return [
        f"{L.role_name(owner.name, index, role)}-{rank}"
        for role, ranks in (("attention", spec.pods("attention")), ("ffn", spec.pods("ffn")))
        for rank in range(ranks)
    ]


def _report(spec: AFDDeploymentSpec, views: list[GroupView], memories: dict[int, GroupMemory],
            plan: Plan, now: float) -> tuple[list[GroupReport], list[str]]:
    by_index = {a.index: a for a in plan.actions}
    reports: list[GroupReport] = []
    problems: list[str] = []
    for v in views:
        memory, action = memories[v.state.index], by_index.get(v.state.index)
        phase, ready, message = ("Ready" if v.state.ready else "Starting"), v.state.ready, v.lost_reason
        if action is not None and action.kind == "delete":
            continue
        if memory.draining_since is not None:
            reports.append(GroupReport(memory, "Draining", False, v.ready_attention, v.ready_ffn,
                                       "scale-down: finishing its requests, then deleted"))
            continue
        if action is not None and action.kind == "replace":
            memory, phase, ready = GroupMemory(v.state.index, spec.revision, topology=str(spec.topology)), "Replacing", False
        elif action is not None and action.kind == "restart":
            memory = replace(memory, restarts=memory.restarts + 1, last_restart=now, ready_since=None)
            phase, ready = "Restarting", False
            problems.append(f"group {v.state.index} restarted: {v.lost_reason}")
        elif memory.failed or (action is not None and action.kind == "fail"):
            memory, phase = replace(memory, failed=True), "Failed"
            problems.append(f"group {v.state.index} failed after {memory.restarts} restart(s): {v.lost_reason}")
        elif v.state.index in plan.waiting:
            phase = "BackingOff"
            problems.append(f"group {v.state.index} lost a rank ({v.lost_reason}); "
                            f"restart in {plan.waiting[v.state.index]:.0f}s")
        elif v.lost_reason:
            phase = "Degraded"
            if spec.restart_type != RECREATE:
                message = f"{v.lost_reason}; waiting for the runtime to reconnect (restartPolicy None)"
            problems.append(f"group {v.state.index}: {message}")
        reports.append(GroupReport(memory, phase, ready, v.ready_attention, v.ready_ffn, message))
    for action in plan.actions:
        if action.kind == "create":
            reports.append(GroupReport(GroupMemory(action.index, spec.revision, topology=str(spec.topology)),
                                       "Creating", False))
    return reports, problems


def _action_event(action: Action, views: list[GroupView]) -> Event:
    kind, reason = _EVENT_OF_ACTION[action.kind]
    lost = next((v.lost_reason for v in views if v.state.index == action.index), "")
    detail = f" ({lost})" if lost and action.kind in ("restart", "fail") else ""
    target = f" at revision {action.revision}" if action.kind in ("create", "replace") else ""
    return Event(kind, reason, f"group {action.index}{target}: {action.reason}{detail}")


def _condition_events(previous: list, current: list) -> list[Event]:
    events = []
    for c in transitions(previous, current):
        if c["type"] == "Ready" and c["status"] == "True":
            events.append(Event("Normal", "Ready", c["message"]))
        elif c["type"] == "Degraded" and c["status"] == "True":
            events.append(Event("Warning", c["reason"], c["message"]))
    return events


def _invalid(message: str, previous: Mapping[str, Any], generation: Optional[int], now: float) -> Outcome:
    status = dict(previous)
    status["observedGeneration"] = generation
    status["conditions"] = merge_conditions(previous.get("conditions") or [],
                                            invalid_spec_conditions(message), generation, now)
    before = {c.get("type"): c.get("message") for c in previous.get("conditions") or []}
    events = [Event("Warning", "InvalidSpec", message)] if before.get("Degraded") != message else []
    log.warning("invalid spec, nothing applied: %s", message)
    return Outcome(status, events)
