"""What the operator sees of its groups: pod facts and per-group observations. Pure.

The operator's memory of each group (revision, restarts, when it was last Ready) lives
in `status.groups` of the custom resource, written only by the reconciler. Pods are
read from kopf's in-memory index; nothing here talks to the API.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Optional

from afd.config.topology import Topology
from afd_operator.model.labels import GROUP, NAME, REVISION, ROLE
from afd_operator.groups.plan import GroupState


@dataclass(frozen=True)
class PodFacts:
    """The few facts about one role pod that decide readiness and rank loss."""

    name: str
    group: int
    role: str
    revision: str
    phase: str
    ready: bool
    restarts: int
    created: Optional[float]  # epoch seconds
    deleting: bool = False
    ip: str = ""  # where its /metrics is scraped for spec.ratio


@dataclass(frozen=True)
class GroupMemory:
    """What the operator remembers of a group between reconciles (status.groups[])."""

    index: int
    revision: str
    restarts: int = 0
    last_restart: Optional[float] = None
    ready_since: Optional[float] = None
    restart_baseline: int = 0  # container restarts already counted when the group became Ready
    failed: bool = False
    topology: Optional[str] = None  # the shape it was created with (ratio changes roll out group by group)
    draining_since: Optional[float] = None  # spec.autoscaling removes it once drained (epoch seconds)


@dataclass(frozen=True)
class GroupView:
    """A group as observed now: its planner state and its counts for status."""

    state: GroupState
    memory: GroupMemory
    ready_attention: int
    ready_ffn: int
    pod_restarts: int = 0  # container restarts summed over the group's pods
    pod_names: tuple[str, ...] = ()
    lost_reason: str = ""


def pod_facts(body: Mapping[str, Any]) -> Optional[PodFacts]:
    """Facts of one pod body, or None when it is not a role pod of ours."""
    meta = body.get("metadata", {})
    labels = meta.get("labels") or {}
    if NAME not in labels or GROUP not in labels or ROLE not in labels:
        return None
    status = body.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    restarts = sum(int(c.get("restartCount", 0)) for c in status.get("containerStatuses") or [])
    return PodFacts(
        name=meta.get("name", ""),
        group=int(labels[GROUP]),
        role=labels[ROLE],
        revision=labels.get(REVISION, ""),
        phase=status.get("phase") or "Pending",
        ready=ready,
        restarts=restarts,
        created=parse_time(meta.get("creationTimestamp")),
        deleting=bool(meta.get("deletionTimestamp")),
        ip=status.get("podIP") or "",
    )


def observe_groups(
    memories: Iterable[GroupMemory],
    pods: Iterable[PodFacts],
    attention_ranks: int,
    ffn_ranks: int,
    ffn_shards: int = 1,
) -> list[GroupView]:
    """Join remembered groups with their pods (`ffn_ranks` counts FFN pods; a group's remembered
    topology counts ranks, each of `ffn_shards` pods). Groups seen only through pods are adopted
    (e.g. after the status was lost), with the revision their pods carry, unless all of those
    pods are being deleted (a group just deleted, its pods in their preStop drain)."""
    by_group: dict[int, list[PodFacts]] = {}
    for pod in pods:
        by_group.setdefault(pod.group, []).append(pod)
    known = {m.index: m for m in memories}
    for index, group_pods in by_group.items():
        if index not in known and not all(p.deleting for p in group_pods):  # a deleted group's pods stopping
            known[index] = GroupMemory(index=index, revision=group_pods[0].revision)
    return [
        _observe_one(known[i], by_group.get(i, []), attention_ranks, ffn_ranks, ffn_shards) for i in sorted(known)
    ]


def _observe_one(memory: GroupMemory, pods: list[PodFacts], attention: int, ffn: int, ffn_shards: int) -> GroupView:
    if memory.topology:  # judged by its own shape, not by the one a rollout moves towards
        shape = Topology.parse(memory.topology)
        attention, ffn = shape.num_attention, shape.num_ffn * ffn_shards
    current = [p for p in pods if not p.deleting]
    ready_attention = sum(p.ready and p.role == "attention" for p in current)
    ready_ffn = sum(p.ready and p.role == "ffn" for p in current)
    same_revision = all(p.revision == memory.revision for p in current)
    ready = same_revision and ready_attention == attention and ready_ffn == ffn
    pending = any(p.phase == "Pending" for p in current)
    lost_reason = _lost_reason(memory, current, attention + ffn)
    state = GroupState(
        index=memory.index,
        revision=memory.revision,
        ready=ready,
        pending=pending,
        lost=bool(lost_reason),
        failed=memory.failed,
        restarts=memory.restarts,
        last_restart=memory.last_restart,
    )
    pod_restarts = sum(p.restarts for p in current)
    names = tuple(sorted(p.name for p in pods))
    return GroupView(state, memory, ready_attention, ready_ffn, pod_restarts, names, lost_reason)


def _lost_reason(memory: GroupMemory, pods: list[PodFacts], expected: int) -> str:
    """Why a rank counts as lost, or "" when none is. Only a group that was Ready can
    lose a rank: before that, missing or restarting pods are still starting up."""
    if memory.ready_since is None:
        return ""
    failed = [p.name for p in pods if p.phase in ("Failed", "Unknown")]
    if failed:
        return f"pod {failed[0]} is {next(p.phase for p in pods if p.name == failed[0])}"
    if len(pods) < expected:
        return f"{expected - len(pods)} of {expected} pods are missing"
    # The API server keeps whole seconds: a pod from the second the group became Ready is not new.
    since = math.floor(memory.ready_since)
    replaced = [p.name for p in pods if p.created is not None and math.floor(p.created) > since]
    if replaced:
        return f"pod {replaced[0]} was recreated after the group became Ready"
    restarts = sum(p.restarts for p in pods)
    if restarts > memory.restart_baseline:
        return f"{restarts - memory.restart_baseline} container restart(s) since the group became Ready"
    return ""


def remember(view: GroupView, now: float, reset_after: float, runtime_recovers: bool = False) -> GroupMemory:
    """The memory to keep after observing `view` (before any action is applied).

    With `runtime_recovers` (restart policy None) a group that lost a rank and is fully
    Ready again has recovered by itself: its baseline moves to now."""
    memory = view.memory
    if view.state.ready and view.lost_reason and runtime_recovers:
        memory = replace(memory, ready_since=now, restart_baseline=view.pod_restarts)
    if view.state.ready and memory.ready_since is None and not view.lost_reason:
        # Restarts during start-up are not losses; later ones are compared with this baseline.
        memory = replace(memory, ready_since=now, restart_baseline=view.pod_restarts)
    if memory.ready_since is not None and memory.restarts and now - memory.ready_since >= reset_after:
        memory = replace(memory, restarts=0)  # stable long enough: forgive earlier restarts
    return memory


def parse_time(text: Optional[str]) -> Optional[float]:
    if not text:
        return None
    return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()


def format_time(epoch: Optional[float]) -> Optional[str]:
    if epoch is None:
        return None
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
