"""spec.autoscaling inside one reconcile: the decision, and the drain of a leaving group. Pure.

A group leaves in three steps, so no request fails:

1. it is chosen (a group that is not Ready first, else the highest index) and marked draining
   (`status.groups[].drainingSince`); from then on it is outside the group planner (no
   rollout, restart or scale touches it, and its index is not reused);
2. while any of its attention pods is Ready the operator calls that rank's `/drain?seconds=0`
   (the endpoint of the pods' preStop hook): readiness turns 503, so the kubelet takes the pod
   out of the client Service, while the rank serves on and finishes what it runs;
3. once no attention pod of it is Ready and a scrape taken after the drain began shows no
   request running or waiting on it, it is deleted; after `drainTimeoutSeconds` it is deleted
   anyway (a rank the operator cannot reach stays Ready).

With `afd.attentionEngine: vllm` (whose server has no `/drain`) the group is deleted at once and
its pods' preStop sleep and shutdown grace are all the drain there is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

from afd_operator.autoscaler.group_count import Groups, decide
from afd_operator.model.spec import AFDDeploymentSpec
from afd_operator.groups.observe import GroupMemory, GroupView, PodFacts
from afd_operator.groups.plan import Action, GroupState
from afd_operator.autoscaler.signals import ServiceSample, load_of

History = Sequence[ServiceSample]  # one group's scrapes, oldest first


@dataclass
class ScaleStep:
    spec: AFDDeploymentSpec  # replicas: the group count to plan for
    memories: dict[int, GroupMemory]  # draining groups carry drainingSince
    planned: list[GroupState]  # the states the group planner sees (draining groups left out)
    reserved: frozenset[int] = frozenset()  # draining groups' indices
    deletes: list[Action] = field(default_factory=list)  # drained groups
    drain_pods: list[PodFacts] = field(default_factory=list)  # Ready attention pods of draining groups
    status: Optional[dict[str, Any]] = None  # status.autoscaling (None: off)
    events: list[tuple[str, str, str]] = field(default_factory=list)


def scale_step(spec: AFDDeploymentSpec, views: list[GroupView], memories: dict[int, GroupMemory],
               states: list[GroupState], pods: list[PodFacts], service: Mapping[int, History],
               previous: Mapping[str, Any], now: float) -> ScaleStep:
    """What spec.autoscaling changes in this reconcile. `service`: each group's recent scrapes;
    `previous`: status.autoscaling."""
    policy = spec.autoscaling
    draining = {i for i, m in memories.items() if m.draining_since is not None}
    staying = [v for v in views if v.state.index not in draining]
    step = ScaleStep(spec, dict(memories), states)
    if policy.enabled:
        ready = [v.state.index for v in staying if v.state.ready]
        missing = [i for i in ready if i not in service]
        load = load_of({i: service[i] for i in ready}) if ready and not missing else None
        # warming: not Ready since it was made (created, restarted or replaced); a group that lost a
        # rank after being Ready is not, or a broken group would hold the autoscaler forever
        warming = sum(not v.state.ready and step.memories[v.state.index].ready_since is None for v in staying)
        groups = Groups(len(staying), warming, len(draining), str(spec.topology))
        decision = decide(policy, load, previous, groups, spec.replicas, now)
        step.status, desired = decision.status, decision.desired
        if load is None and decision.event is None and not decision.status["reason"].startswith("holding"):
            decision.status["reason"] = (f"waiting for the metrics of group(s) {missing}" if missing
                                         else "no Ready group to read metrics from")
        step.events += [decision.event] if decision.event else []
        by_choice = sorted(staying, key=lambda v: (not v.state.ready, v.state.index), reverse=True)  # broken ones first
        leaving = [v.state.index for v in by_choice][:max(0, len(staying) - desired)]
        for index in leaving:
            step.memories[index] = replace(memories[index], draining_since=now)
            draining.add(index)
            step.events.append(("Normal", "GroupDraining", f"group {index}: scale-down; its attention ranks stop "
                                "taking requests and finish what they run, then the group is deleted"))
        step.spec = spec.model_copy(update={"replicas": desired})
    step.planned = [s for s in states if s.index not in draining]
    step.reserved = frozenset(draining)
    for index in sorted(draining):
        since = step.memories[index].draining_since
        attention = [p for p in pods if p.group == index and p.role == "attention" and not p.deleting]
        ready = [p for p in attention if p.ready]
        sample = service[index][-1] if service.get(index) else None
        idle = sample is not None and sample.at > since and sample.in_flight == 0
        timed_out = now - since >= policy.drain_timeout_seconds
        if spec.afd.attention_engine == "vllm":  # vLLM's server has no /drain: its pods' preStop sleep is all
            step.deletes.append(Action("delete", index, reason="ScaleDown (vLLM attention ranks: preStop only)"))
        elif timed_out or (not ready and (idle or not attention)):  # past the timeout even if a rank stays Ready
            why = "drained" if idle or not attention else f"drain timed out after {now - since:.0f}s"
            step.deletes.append(Action("delete", index, reason=f"ScaleDown ({why})"))
        else:
            step.drain_pods += ready
    return step

