"""The group planner: desired shape + observed groups → the next actions. Pure.

A group is the unit of everything here: it is created, replaced, restarted and deleted
as a whole, so a group never mixes revisions (attention and FFN must speak the same wire
version). Rollouts follow Deployment semantics counted in groups: at most
`replicas + maxSurge` groups exist, at least `replicas - maxUnavailable` stay Ready, and
groups below `partition` keep their revision. The planner is called again after every
change (and on a timer), so each call plans one safe step, never a whole rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

RECREATE = "RecreateGroupOnRankFailure"

ActionKind = Literal["create", "replace", "restart", "delete", "fail"]


@dataclass(frozen=True)
class Desired:
    """What the spec asks for, reduced to what the planner needs."""

    replicas: int
    revision: str
    max_surge: int = 0
    max_unavailable: int = 1
    partition: int = 0
    restart_type: str = "None"
    backoff_seconds: float = 30.0
    max_backoff_seconds: float = 600.0
    max_restarts: Optional[int] = None
    reserved: frozenset[int] = frozenset()  # indices of groups outside the plan (draining): never reused


@dataclass(frozen=True)
class GroupState:
    """One existing group as observed now, plus what the operator remembers of it."""

    index: int
    revision: str
    ready: bool = False  # every rank Ready
    pending: bool = False  # some pod is Pending (scheduling, pulling, initialising)
    lost: bool = False  # a rank died or was replaced since the group was last Ready
    failed: bool = False  # restart budget spent; left alone until the revision changes
    restarts: int = 0  # consecutive operator restarts (reset once the group stays Ready)
    last_restart: Optional[float] = None  # epoch seconds


@dataclass(frozen=True)
class Action:
    """One step for the applier. `replace` re-renders a group at `revision` and
    deletes all its pods at once; `restart` deletes all its pods, keeping the revision."""

    kind: ActionKind
    index: int
    revision: Optional[str] = None
    reason: str = ""


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...] = ()
    waiting: dict[int, float] = field(default_factory=dict)  # group → seconds of backoff left


def restart_delay(restarts: int, base: float, cap: float) -> float:
    """Backoff before restart number `restarts + 1`: the first is immediate, then base·2ⁿ up to cap."""
    if restarts <= 0:
        return 0.0
    return float(min(base * 2 ** (restarts - 1), cap))


def plan_groups(desired: Desired, groups: list[GroupState], now: float) -> Plan:
    """The next safe step from `groups` towards `desired`."""
    actions: list[Action] = []
    restart_actions, waiting = _plan_restarts(desired, groups, now)
    actions += restart_actions
    busy = {a.index for a in restart_actions}

    live = sorted(groups, key=lambda g: g.index)
    updatable = [g for g in live if g.revision != desired.revision and g.index >= desired.partition]
    limit = desired.replicas + (desired.max_surge if updatable else 0)

    # Scale-down past the surge allowance is not a rollout: delete at once, worst first.
    excess = len(live) - limit
    if excess > 0:
        doomed = sorted(live, key=lambda g: (g.revision == desired.revision, g.ready, -g.index))[:excess]
        actions += [Action("delete", g.index, reason="ScaleDown") for g in doomed]
        gone = {g.index for g in doomed}
        live = [g for g in live if g.index not in gone]
        updatable = [g for g in updatable if g.index not in gone]

    # Create up to `replicas`, plus surge groups while old ones remain to be replaced.
    target = desired.replicas + min(desired.max_surge, len(updatable))
    used = {g.index for g in live} | desired.reserved
    free = (i for i in range(10**6) if i not in used)
    created = [next(free) for _ in range(max(0, target - len(live)))]
    actions += [Action("create", i, desired.revision, reason="ScaleUp") for i in created]
    total = len(live) + len(created)

    # Take old groups down: not-Ready ones cost nothing, Ready ones spend the unavailability budget.
    available = sum(1 for g in live if g.ready and g.index not in busy)
    budget = available - (desired.replicas - desired.max_unavailable)
    for g in sorted(updatable, key=lambda g: (g.ready, -g.index)):
        if g.index in busy:
            continue
        if g.ready:
            if budget <= 0:
                continue
            budget -= 1
        if total > desired.replicas:
            actions.append(Action("delete", g.index, reason="RolloutSurplus"))
            total -= 1
        else:
            actions.append(Action("replace", g.index, desired.revision, reason="Rollout"))

    return Plan(tuple(actions), waiting)


def _plan_restarts(
    desired: Desired, groups: list[GroupState], now: float
) -> tuple[list[Action], dict[int, float]]:
    actions: list[Action] = []
    waiting: dict[int, float] = {}
    if desired.restart_type != RECREATE:
        return actions, waiting
    for g in sorted(groups, key=lambda g: g.index):
        if not g.lost or g.failed or g.pending:
            continue  # a Pending pod may be an image pull or a full node: never restart for it
        if desired.max_restarts is not None and g.restarts >= desired.max_restarts:
            actions.append(Action("fail", g.index, reason="RestartBudgetExhausted"))
            continue
        delay = restart_delay(g.restarts, desired.backoff_seconds, desired.max_backoff_seconds)
        elapsed = now - g.last_restart if g.last_restart is not None else float("inf")
        if elapsed < delay:
            waiting[g.index] = delay - elapsed
            continue
        actions.append(Action("restart", g.index, g.revision, reason="RankLost"))
    return actions, waiting
