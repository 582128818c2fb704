"""spec.autoscaling: how many groups, from the service levels the groups meet. Pure.

Each evaluation takes the latest `Load` (autoscaler.signals) and the previous status.autoscaling
and returns the desired group count, the new status and the Event of a change:

- up when a target is missed at every evaluation for `scaleUpWindowSeconds`: one group, or for
  the load-proportional signals (waiting requests, KV-cache use) as many as bring them back
  under their targets, up to `maxGroups`;
- down by one group when, at every evaluation for `scaleDownWindowSeconds`, the load would fit
  in one group fewer with `scaleDownMarginPercent` to spare: waiting requests and KV use
  projected onto n-1 groups (×n/(n-1)), latencies over the span of scrapes kept (the feed keeps
  the scale-down window) below their targets with the margin, and, once a
  latency miss has added a group, the requests per group projected below the load at that decision
  (latency does not scale with load, so that load is what a group was seen not to carry; a lone
  spike does not set it, as it never lasts a window);
- never outside minGroups..maxGroups, never while a group warms up (the windows restart once it
  serves), no removal while another group still drains (an addition may come), at most one change
  per `cooldownSeconds`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from afd_operator.model.autoscaling import Autoscaling
from afd_operator.groups.observe import format_time, parse_time
from afd_operator.autoscaler.signals import Load

PROPORTIONAL = ("waitingPerGroup", "kvCacheUsage")  # signals that grow with the load per group
LATENCIES = ("ttftP90Seconds", "itlP90Seconds")
# Written as null when they do not apply: the status is merge-patched, and only null removes a key.
OPTIONAL = ("signal", "lastDecisionTime", "lastEvaluationTime", "lastSampleTime", "missedSince", "roomSince",
            "observed", "saturationConcurrencyPerGroup", "saturationTopology")


@dataclass(frozen=True)
class Groups:
    """The groups as this reconcile sees them."""

    serving: int  # existing groups that are not leaving
    warming: int = 0  # of those, not Ready yet
    draining: int = 0  # groups leaving
    shape: str = ""  # the groups' topology (a group of another shape carries another load)


@dataclass(frozen=True)
class Decision:
    desired: int
    status: dict[str, Any]  # status.autoscaling
    event: Optional[tuple[str, str, str]] = None  # (type, reason, message)


def initial_groups(policy: Autoscaling, previous: Mapping[str, Any], replicas: int) -> int:
    """The group count the autoscaler stands at: its last decision, else spec.replicas; within bounds."""
    desired = previous.get("desiredGroups")
    return policy.clamp(int(desired) if isinstance(desired, int) else replicas)


def decide(policy: Autoscaling, load: Optional[Load], previous: Mapping[str, Any], groups: Groups,
           replicas: int, now: float) -> Decision:
    """The desired group count, status.autoscaling and the Event of this evaluation."""
    before = initial_groups(policy, previous, replicas)
    status = dict.fromkeys(OPTIONAL) | {k: previous[k] for k in OPTIONAL if previous.get(k) is not None} | {
        "desiredGroups": before, "currentGroups": groups.serving,
        "reason": previous.get("reason") or "waiting for the attention ranks' metrics",
    }  # what changes only with news, so that a resync with nothing new writes no status
    if previous.get("desiredGroups") is not None and before != previous["desiredGroups"]:
        status |= {"signal": "bounds", "lastDecisionTime": format_time(now), "lastEvaluationTime": format_time(now),
                   "missedSince": None, "roomSince": None,
                   "reason": f"minGroups..maxGroups is {policy.min_groups}..{policy.max_groups} now"}
        return Decision(before, status, ("Normal", "AutoscaleBounds",
                                         f"{previous['desiredGroups']} -> {before} group(s): {status['reason']}"))
    saturation = previous.get("saturationConcurrencyPerGroup")
    if saturation is not None and previous.get("saturationTopology") != groups.shape:  # spec.ratio changed the groups
        saturation = status["saturationConcurrencyPerGroup"] = status["saturationTopology"] = None
    fresh = load is not None and load.at > (parse_time(previous.get("lastSampleTime")) or float("-inf"))
    if fresh:
        status |= {"lastSampleTime": format_time(math.floor(load.at)), "lastEvaluationTime": format_time(now),
                   "observed": {k: round(v, 4) for k, v in load.signals().items()} | {
                       "concurrencyPerGroup": round(load.concurrency_per_group, 3)}}
    hold = _hold(policy, groups, previous, now)
    if hold:  # the windows restart once the groups have settled
        status |= {"missedSince": None, "roomSince": None, "reason": f"holding: {hold}"}
        return Decision(before, status)
    if not fresh:
        return Decision(before, status)  # nothing new to judge
    assert load is not None

    targets = policy.targets.configured()
    signals = load.signals()
    misses = {name: signals[name] / target for name, target in targets.items()
              if name in signals and signals[name] > target}
    room, binding = _room(policy, load, signals, targets, saturation, before - 1)
    missed_since = _since(previous.get("missedSince"), bool(misses), now)
    # a draining group still carries requests: the next removal waits until it has gone (a surge may add one)
    room_since = _since(previous.get("roomSince"), room and before > policy.min_groups and not groups.draining, now)
    status |= {"missedSince": format_time(missed_since), "roomSince": format_time(room_since)}

    if misses:
        worst = max(misses, key=misses.get)
        what = f"{worst} {signals[worst]:.3g} > target {targets[worst]:g}"
        if before >= policy.max_groups:
            status["reason"] = f"{what}, but already at maxGroups ({policy.max_groups})"
        elif now - missed_since < policy.scale_up_window_seconds:
            status["reason"] = f"{what} for {now - missed_since:.0f}s of the {policy.scale_up_window_seconds}s window"
        else:
            proportional = [misses[name] for name in misses if name in PROPORTIONAL]
            wanted = math.ceil(load.groups * max(proportional)) if proportional else before + 1
            after = policy.clamp(max(before + 1, wanted))
            if any(name in LATENCIES for name in misses):  # what a group was seen to carry, missing a latency
                status |= {"saturationConcurrencyPerGroup": round(load.concurrency_per_group, 3),
                           "saturationTopology": groups.shape}
            return _changed(status, before, after, worst, f"{what} for {now - missed_since:.0f}s", now, "AutoscaleUp")
        return Decision(before, status)
    if room_since is not None:
        fits = f"the load fits in {before - 1} group(s) ({binding})"
        if now - room_since < policy.scale_down_window_seconds:
            status["reason"] = f"{fits} for {now - room_since:.0f}s of the {policy.scale_down_window_seconds}s window"
            return Decision(before, status)
        return _changed(status, before, before - 1, binding.split(" ")[0], f"{fits} for {now - room_since:.0f}s", now,
                        "AutoscaleDown")
    status["reason"] = ("every target met" + (f"; at minGroups ({policy.min_groups})" if before <= policy.min_groups
                                               else f"; {groups.draining} group(s) still draining" if groups.draining
                                               else f"; {binding}"))
    return Decision(before, status)


def _room(policy: Autoscaling, load: Load, signals: Mapping[str, float], targets: Mapping[str, float],
          saturation: Optional[float], after: int) -> tuple[bool, str]:
    """Whether the load of the `load.groups` serving groups would fit in `after` groups with the
    margin (a group that serves nothing leaves for free), and the tightest signal as text."""
    if after < 1:
        return False, "one group left"
    n = load.groups
    scale = n / min(n, after)  # the load each remaining group would carry, relative to now
    keep = 1 - policy.scale_down_margin_percent / 100
    spans = {"ttftP90Seconds": load.ttft_p90_span, "itlP90Seconds": load.itl_p90_span}
    signals = {**signals, **{k: v for k, v in spans.items() if v is not None}}  # latencies over the span kept
    projected = {name: signals.get(name, 0.0) * (scale if name in PROPORTIONAL else 1.0) for name in targets}
    limits = dict(targets)
    if saturation:
        projected["concurrencyPerGroup"] = load.concurrency_per_group * scale
        limits["concurrencyPerGroup"] = saturation
    ratios = {name: projected[name] / (limits[name] * keep) if limits[name] * keep > 0 else math.inf
              for name in limits}
    tightest = max(ratios, key=ratios.get)
    text = f"{tightest} would be {projected[tightest]:.3g} against {limits[tightest] * keep:.3g}"
    return ratios[tightest] <= 1.0, text


def _hold(policy: Autoscaling, groups: Groups, previous: Mapping[str, Any], now: float) -> str:
    """Why no change may be made now, or ''."""
    if groups.warming:
        return f"{groups.warming} group(s) warming up"
    last = parse_time(previous.get("lastDecisionTime"))
    if last is not None and now - last < policy.cooldown_seconds:
        return f"cool-down until {format_time(last + policy.cooldown_seconds)}"
    return ""


def _since(previous: Optional[str], holds: bool, now: float) -> Optional[float]:
    if not holds:
        return None
    return parse_time(previous) if previous else now


def _changed(status: dict[str, Any], before: int, after: int, signal: str, why: str, now: float,
             reason: str) -> Decision:
    status |= {"desiredGroups": after, "signal": signal, "lastDecisionTime": format_time(now),
               "missedSince": None, "roomSince": None, "reason": f"{before} -> {after} group(s): {why}"}
    return Decision(after, status, ("Normal", reason, status["reason"]))
