"""`spec.ratio`: the attention:FFN ratio chosen from the groups' metrics. Pure.

Each group's recent scrapes go to the runtime planner (`afd.planner.advice.plan`, the same
cost model as `afd plan`); the deployment's recommendation is the topology most groups
recommend. Advise reports it in `status.ratio` and an Event. Auto also records it as
`status.ratio.appliedTopology`, which `effective_spec` puts in place of the spec's ranks, so
the revision changes and the ordinary group rollout moves the groups, one safe step at a time.

Hysteresis: the planner recommends a change only above `minGainPercent`; a recommendation
is announced, and Auto acts on it, once seen in `CONFIRMATIONS` consecutive evaluations, at most once per
`cooldownSeconds`, never during a rollout, and only when the rollout can keep `minAvailable`
groups Ready. Scrapes of another topology than the group's current one are never used.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from afd.planner.advice import Bounds, TooFewMetrics, plan
from afd.planner.samples import RankSample
from afd.config.topology import Topology, TopologyError
from afd_operator.model.spec import AFDDeploymentSpec
from afd_operator.model.options import Ratio
from afd_operator.groups.observe import format_time, parse_time

CONFIRMATIONS = 2  # consecutive evaluations that must agree before Auto acts
# Written as null when they do not apply: the status is merge-patched, and only null removes a key.
OPTIONAL = ("recommended", "predictedGainPercent", "lastSampleTime", "appliedTopology", "basedOn", "lastChangeTime")

Scrapes = list[list[RankSample]]


@dataclass(frozen=True)
class Fleet:
    """The groups as this reconcile sees them: what Auto needs to act safely."""

    replicas: int
    ready: int  # Ready groups at the update revision
    settled: bool  # every group at the update revision and Ready: no rollout in progress
    max_surge: int
    max_unavailable: int


@dataclass(frozen=True)
class RatioOutcome:
    status: Optional[dict[str, Any]]  # status.ratio (None: mode Off)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)


def bounds_of(ratio: Ratio) -> Bounds:
    return Bounds(ratio.min_attention_per_ffn, ratio.max_attention_per_ffn, ratio.max_ranks_per_group,
                  ratio.min_gain_percent / 100)


def within(ratio: Ratio, topology: Topology) -> bool:
    """Whether `topology` respects the ratio bounds and the group size bound."""
    per_ffn = topology.num_attention / topology.num_ffn
    return (ratio.min_attention_per_ffn <= per_ffn <= ratio.max_attention_per_ffn
            and topology.num_attention + topology.num_ffn <= ratio.max_ranks_per_group)


def applied_topology(spec: AFDDeploymentSpec, status: Mapping[str, Any]) -> Optional[Topology]:
    """The topology Auto chose, while it still applies: mode Auto, chosen over the spec's
    current ranks (an edit of the ranks wins over it), and within the bounds."""
    state = status.get("ratio") or {}
    if spec.ratio.mode != "Auto" or not state.get("appliedTopology") or state.get("basedOn") != str(spec.topology):
        return None
    try:
        topology = Topology.parse(state["appliedTopology"])
    except TopologyError:
        return None
    return topology if within(spec.ratio, topology) else None  # maxRanksPerGroup <= 256 bounds each role


def effective_spec(spec: AFDDeploymentSpec, status: Mapping[str, Any]) -> AFDDeploymentSpec:
    """`spec` with the ranks Auto chose, or `spec` itself."""
    topology = applied_topology(spec, status)
    if topology is None:
        return spec
    return spec.model_copy(update={
        "attention": spec.attention.model_copy(update={"ranks": topology.num_attention}),
        "ffn": spec.ffn.model_copy(update={"ranks": topology.num_ffn}),
    })


def safe_unavailable(ratio: Ratio, replicas: int, rollout_max_unavailable: int, max_surge: int) -> Optional[int]:
    """The rollout's unavailability budget that keeps `minAvailable` groups Ready; None when no
    rollout could progress within it (no budget left and no surge)."""
    clamped = min(rollout_max_unavailable, max(0, replicas - ratio.min_available))
    return clamped if clamped > 0 or max_surge > 0 else None


def max_unavailable(ratio: Ratio, replicas: int, rollout_max_unavailable: int, max_surge: int) -> int:
    """The planner's budget: under Auto the safe one; where that would stall every rollout (Auto
    then makes no change), the spec's, so that the user's own rollouts still progress."""
    safe = safe_unavailable(ratio, replicas, rollout_max_unavailable, max_surge) if ratio.mode == "Auto" else None
    return rollout_max_unavailable if safe is None else safe


def decide(spec: AFDDeploymentSpec, topology: Topology, scrapes: Mapping[int, Scrapes],
           previous: Mapping[str, Any], fleet: Fleet, now: float) -> RatioOutcome:
    """status.ratio and the events of this reconcile. `topology` is the effective one (Auto's
    choice or the spec's), `scrapes` the recent scrapes per group, oldest first."""
    ratio = spec.ratio
    if ratio.mode == "Off":
        return RatioOutcome(None)
    carried = {k: previous[k] for k in ("appliedTopology", "basedOn", "lastChangeTime") if previous.get(k)}
    if carried and applied_topology(spec, {"ratio": carried}) is None:
        carried = {k: v for k, v in carried.items() if k == "lastChangeTime"}  # the spec's ranks rule again
    latest = max((s.at for group in scrapes.values() for scrape in group for s in scrape), default=None)
    fresh = latest is not None and math.floor(latest) > (parse_time(previous.get("lastSampleTime")) or 0.0)
    if not fresh and previous.get("mode") == ratio.mode and previous.get("current") == str(topology):
        return RatioOutcome(dict(previous) | {"mode": ratio.mode})  # nothing new to judge

    advice = {index: _advise(_of_topology(group, topology), bounds_of(ratio)) for index, group in sorted(scrapes.items())}
    recommended, gain, why = _combine(advice, topology)
    streak = int(previous.get("streak", 0)) + 1 if recommended and recommended == previous.get("recommended") else 1
    status: dict[str, Any] = dict.fromkeys(OPTIONAL) | {
        "mode": ratio.mode, "current": str(topology), "reason": why, "streak": streak if recommended else 0,
        "lastEvaluationTime": format_time(now),
        "groups": [_group_status(index, result) for index, result in advice.items()],
        **({"recommended": recommended, "predictedGainPercent": round(100 * gain)} if recommended else {}),
        **({"lastSampleTime": format_time(latest)} if latest is not None else {}),
        **carried,
    }
    events: list[tuple[str, str, str]] = []
    change = recommended is not None and recommended != str(topology)
    if change and streak == CONFIRMATIONS:  # announced once confirmed: a noisy stream does not flood Events
        events.append(("Normal", "RatioRecommended",
                       f"{recommended} instead of {topology}: {gain:+.0%} tokens/s per GPU predicted; {why}"))
    if change and ratio.mode == "Auto":
        hold = _hold(ratio, streak, status, fleet, now)
        if hold:
            status["reason"] = f"{why}; Auto waits: {hold}"
        else:
            status |= {"appliedTopology": recommended, "basedOn": str(spec.topology),
                       "lastChangeTime": format_time(now), "streak": 0}
            events.append(("Normal", "RatioChanged", f"moving the groups from {topology} to {recommended} "
                           f"through a rollout ({gain:+.0%} tokens/s per GPU predicted)"))
    return RatioOutcome(status, events)


def _of_topology(group: Scrapes, topology: Topology) -> Scrapes:
    """The scrapes taken while the group ran `topology` (afd_group_info says; unlabelled ones count)."""
    def matches(scrape: list[RankSample]) -> bool:
        seen = {s.info.get("topology") for s in scrape if s.info.get("topology")}
        return bool(scrape) and seen <= {str(topology)}
    return [scrape for scrape in group if matches(scrape)]


def _advise(group: Scrapes, bounds: Bounds) -> dict[str, Any] | str:
    """The planner's answer for one group, or why it has none."""
    try:
        return plan(group, bounds)
    except TooFewMetrics as err:
        return f"too few metrics: {err}"
    except (ValueError, ZeroDivisionError) as err:
        return f"cannot fit: {err}"


def _combine(advice: Mapping[int, dict | str], topology: Topology) -> tuple[Optional[str], float, str]:
    """The topology most groups recommend (ties keep the current one), the median gain of the
    groups that recommend it, and the reason; (None, 0, why) when no group has an answer."""
    answers = {i: r for i, r in advice.items() if isinstance(r, dict) and r.get("recommended")}
    if not answers:
        reasons = [f"group {i}: {r if isinstance(r, str) else r['why']}" for i, r in advice.items()]
        return None, 0.0, "; ".join(reasons)[:900] or "no group has metrics yet"
    votes = Counter(r["recommended"] for r in answers.values())
    leaders = [t for t, n in votes.items() if n == max(votes.values())]
    if len(leaders) > 1:
        return str(topology), 0.0, f"the groups disagree ({dict(sorted(votes.items()))}): keeping {topology}"
    chosen = leaders[0]
    backers = [r for r in answers.values() if r["recommended"] == chosen]
    gains = sorted(r.get("predicted_gain", 0.0) for r in backers)
    reason = backers[0]["why"] + (f" ({len(backers)}/{len(advice)} groups agree)" if len(advice) > 1 else "")
    return chosen, gains[len(gains) // 2], reason[:900]


def _hold(ratio: Ratio, streak: int, status: Mapping[str, Any], fleet: Fleet, now: float) -> str:
    """Why Auto must not act now, or ''."""
    last = parse_time(status.get("lastChangeTime"))
    if streak < CONFIRMATIONS:
        return f"seen {streak} of {CONFIRMATIONS} consecutive evaluations"
    if last is not None and now - last < ratio.cooldown_seconds:
        return f"cool-down, {ratio.cooldown_seconds - (now - last):.0f}s left"
    if not fleet.settled:
        return "a rollout is in progress"
    if fleet.ready < ratio.min_available or safe_unavailable(
            ratio, fleet.replicas, fleet.max_unavailable, fleet.max_surge) is None:
        return (f"replacing a group would leave fewer than ratio.minAvailable ({ratio.min_available}) Ready: "
                "allow rollout.maxSurge >= 1 or lower ratio.minAvailable")
    return ""


def _group_status(index: int, result: dict | str) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": index}
    if isinstance(result, dict):
        busy = result.get("busy") or {}
        entry |= {"attentionBusyPercent": round(100 * busy.get("attention", 0.0)),
                  "ffnBusyPercent": round(100 * busy.get("ffn", 0.0))}
        if result.get("recommended"):
            entry["recommended"] = result["recommended"]
    else:
        entry["message"] = result[:300]
    return entry
