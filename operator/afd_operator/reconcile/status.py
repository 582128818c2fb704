"""The AFDDeployment status: group memory in, conditions out. Pure.

Every count and condition is judged against the update revision: a resource whose old
groups are all Ready is not Ready while a rollout is pending. kopf has no conditions
support, so conditions are merged by type here (lastTransitionTime moves only when the
status of a condition changes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from afd_operator.model import labels as L
from afd_operator.model.spec import AFDDeploymentSpec
from afd_operator.groups.observe import GroupMemory, format_time, parse_time

CONDITION_TYPES = ("Ready", "Available", "Progressing", "Degraded", "Failed")


@dataclass(frozen=True)
class GroupReport:
    """One group after this reconcile, as the status shows it."""

    memory: GroupMemory
    phase: str
    ready: bool
    ready_attention: int = 0
    ready_ffn: int = 0
    message: str = ""


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str = ""


@dataclass(frozen=True)
class StatusInput:
    spec: AFDDeploymentSpec
    name: str
    generation: Optional[int]
    groups: list[GroupReport] = field(default_factory=list)
    degraded: list[str] = field(default_factory=list)  # human-readable problems


def memories_from_status(status: Mapping[str, Any]) -> list[GroupMemory]:
    """The operator's memory of its groups, from `status.groups` of the resource."""
    result = []
    for g in status.get("groups") or []:
        result.append(GroupMemory(
            index=int(g["index"]),
            revision=str(g.get("revision", "")),
            restarts=int(g.get("restarts", 0)),
            last_restart=parse_time(g.get("lastRestartTime")),
            ready_since=parse_time(g.get("readySince")),
            restart_baseline=int(g.get("restartBaseline", 0)),
            failed=g.get("phase") == "Failed",
            topology=g.get("topology"),
            draining_since=parse_time(g.get("drainingSince")),
        ))
    return result


def render_status(inp: StatusInput, previous: Mapping[str, Any], now: float) -> dict[str, Any]:
    """The whole status subresource for this reconcile."""
    spec, groups = inp.spec, inp.groups
    revision = spec.revision
    ready = [g for g in groups if g.ready]
    updated = [g for g in groups if g.memory.revision == revision]
    available = [g for g in updated if g.ready]
    old = Counter(g.memory.revision for g in groups if g.memory.revision != revision)
    status: dict[str, Any] = {
        "observedGeneration": inp.generation,
        "replicas": len(groups),
        "readyReplicas": len(ready),
        "updatedReplicas": len(updated),
        "availableReplicas": len(available),
        "groupsReady": f"{len(ready)}/{spec.replicas}",
        "selector": f"{L.NAME}={inp.name},{L.ROLE}=attention",
        "topology": str(spec.topology),
        "currentRevision": old.most_common(1)[0][0] if old else revision,
        "updateRevision": revision,
        "attention": {"desired": spec.replicas * spec.attention.ranks,
                      "ready": sum(g.ready_attention for g in groups)},
        "ffn": {"desired": spec.replicas * spec.pods("ffn"), "ready": sum(g.ready_ffn for g in groups)},
        "groups": [_group_status(g) for g in sorted(groups, key=lambda g: g.memory.index)],
    }
    conditions = judge(inp, len(ready), len(updated), len(available), len(groups))
    status["conditions"] = merge_conditions(previous.get("conditions") or [], conditions, inp.generation, now)
    return status


def judge(inp: StatusInput, ready: int, updated: int, available: int, existing: int) -> list[Condition]:
    """The four conditions, from the counts of this reconcile."""
    spec = inp.spec
    want = spec.replicas
    pinned = existing - updated if spec.rollout.partition else 0
    complete = updated == want == existing and available == want
    if complete:
        ready_c = Condition("Ready", True, "AllGroupsReady", f"{want} group(s) Ready at revision {spec.revision}")
    elif pinned and updated + pinned == existing == want and ready == want:
        ready_c = Condition("Ready", False, "Partitioned",
                            f"{pinned} group(s) held at an older revision by rollout.partition")
    elif updated < existing:
        ready_c = Condition("Ready", False, "RolloutInProgress",
                            f"{updated}/{existing} group(s) at revision {spec.revision}")
    else:
        ready_c = Condition("Ready", False, "GroupsNotReady", f"{available}/{want} group(s) Ready")
    # Like a Deployment's minimum, but a resource with no Ready group is never Available.
    floor = max(min(want, 1), want - spec.rollout.max_unavailable)
    available_c = Condition(
        "Available", ready >= floor, "MinimumGroupsReady" if ready >= floor else "TooFewGroupsReady",
        f"{ready} Ready group(s), at least {floor} required",
    )
    if complete:
        progressing_c = Condition("Progressing", False, "Complete", "nothing left to do")
    else:
        reason = "Scaling" if existing != want else "RollingOut" if updated < existing else "Starting"
        progressing_c = Condition("Progressing", True, reason, ready_c.message)
    degraded_c = (
        Condition("Degraded", True, "GroupProblems", "; ".join(inp.degraded))
        if inp.degraded else Condition("Degraded", False, "AsExpected", "")
    )
    return [ready_c, available_c, progressing_c, degraded_c, _failed(inp)]


def _failed(inp: StatusInput) -> Condition:
    """True while a group has spent its restart budget: nothing restarts it any more."""
    failed = sorted(g.memory.index for g in inp.groups if g.phase == "Failed")
    if not failed:
        return Condition("Failed", False, "NoFailedGroups", "")
    budget = inp.spec.restart_policy.max_restarts
    return Condition(
        "Failed", True, "RestartBudgetExhausted",
        f"group(s) {', '.join(map(str, failed))} lost a rank after restartPolicy.maxRestarts ({budget}) "
        "restart(s) and are left alone; the next revision (any change to the pod spec) replaces them",
    )


def invalid_spec_conditions(message: str) -> list[Condition]:
    """An invalid spec applies nothing: Ready and Progressing false, Degraded true."""
    return [
        Condition("Ready", False, "InvalidSpec", message),
        Condition("Progressing", False, "InvalidSpec", message),
        Condition("Degraded", True, "InvalidSpec", message),
    ]


def merge_conditions(
    previous: Iterable[Mapping[str, Any]], new: Iterable[Condition], generation: Optional[int], now: float
) -> list[dict[str, Any]]:
    """Merge by type; keep lastTransitionTime unless the status flips; keep unknown types."""
    merged = {c["type"]: dict(c) for c in previous if "type" in c}
    for c in new:
        status = "True" if c.status else "False"
        old = merged.get(c.type, {})
        since = old.get("lastTransitionTime") if old.get("status") == status else format_time(now)
        entry = {"type": c.type, "status": status, "reason": c.reason, "message": c.message,
                 "lastTransitionTime": since}
        if generation is not None:
            entry["observedGeneration"] = generation
        merged[c.type] = entry
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(merged.values(), key=lambda c: (order.get(c["type"], len(order)), c["type"]))


def transitions(previous: Iterable[Mapping[str, Any]], current: Iterable[Mapping[str, Any]]) -> list[dict]:
    """Conditions whose status or reason changed (worth an event)."""
    before = {c.get("type"): (c.get("status"), c.get("reason")) for c in previous}
    return [c for c in current if before.get(c["type"]) != (c["status"], c["reason"])]


def _group_status(g: GroupReport) -> dict[str, Any]:
    m = g.memory
    entry: dict[str, Any] = {
        "index": m.index,
        "revision": m.revision,
        "phase": g.phase,
        "readyAttention": g.ready_attention,
        "readyFfn": g.ready_ffn,
        "restarts": m.restarts,
        "restartBaseline": m.restart_baseline,
    }
    optional = {"lastRestartTime": format_time(m.last_restart), "readySince": format_time(m.ready_since),
                "message": g.message, "topology": m.topology, "drainingSince": format_time(m.draining_since)}
    entry.update({k: v for k, v in optional.items() if v})
    return entry
