"""Replay recorded serving scrapes through `autoscale.decide`: a small fleet simulator.

The trace (bench/cluster/record_slo_trace.py) holds one real `afd up` group's attention-rank scrapes at
fixed load levels (C concurrent streams). A simulated group carrying c streams shows the recorded
interval of the level nearest c (on a log scale), the intervals taken in turn, added to its own
cumulative histograms; its scrapes of the scale-down window are kept, as the operator's feed keeps them. The simulator
offers a total load that varies in time, splits it over the Ready groups, asks `decide` each
tick, and applies its answer as the operator would: a new group serves after `warmup_s`, a
leaving group drains for `drain_s` (no traffic) and then goes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from afd_operator.autoscaler.group_count import Groups, decide
from afd_operator.model.autoscaling import Autoscaling
from afd_operator.autoscaler.signals import ServiceSample, delta, load_of, parse_service

TRACE = Path(__file__).parent / "traces" / "cpu-2A1F-levels.json"


class RecordedLevels:
    """Consecutive-scrape pairs of the recorded group, per load level (concurrent streams)."""

    def __init__(self, path: Path = TRACE) -> None:
        record = json.loads(path.read_text())
        self.command = record["command"]
        self.pairs: dict[int, list[tuple[ServiceSample, ServiceSample]]] = {}
        for level in record["levels"]:
            samples = [parse_service(s["text"], s["at"]) for s in level["scrapes"]]
            samples = [s for s in samples if s is not None]
            self.pairs[level["clients"]] = list(zip(samples, samples[1:]))[1:]  # the first spans the switch
        self.levels = sorted(self.pairs)

    def nearest(self, streams: float) -> int:
        return min(self.levels, key=lambda c: abs(math.log1p(c) - math.log1p(streams)))

    def next_sample(self, previous: ServiceSample, streams: float, step: int, at: float) -> ServiceSample:
        """`previous` advanced by a recorded interval of a group carrying `streams`, at `at`."""
        before, after = self.pairs[self.nearest(streams)][step % len(self.pairs[self.nearest(streams)])]
        return replace(after, at=at, ttft=_advance(previous.ttft, after.ttft, before.ttft),
                       itl=_advance(previous.itl, after.itl, before.itl))


def _advance(total, after, before):
    """Cumulative buckets `total` plus the counts added between `before` and `after`."""
    added = dict(delta(after, before))
    old = dict(total)
    return tuple((bound, old.get(bound, 0.0) + added.get(bound, 0.0)) for bound in sorted(set(old) | set(added)))


@dataclass
class Run:
    """What happened: one row per tick, and the decisions."""

    ticks: list[dict] = field(default_factory=list)
    events: list[tuple[float, str, str]] = field(default_factory=list)  # (time, reason, message)

    def groups_at(self, t: float) -> int:
        return [row["desired"] for row in self.ticks if row["t"] <= t][-1]

    def changes(self) -> list[tuple[float, int]]:
        """(time, +1/-1 per group added or removed) of every decision."""
        out, last = [], self.ticks[0]["desired"]
        for row in self.ticks:
            if row["desired"] != last:
                out.append((row["t"], row["desired"] - last))
                last = row["desired"]
        return out


def simulate(policy: Autoscaling, offered: Callable[[float], float], seconds: float, levels: RecordedLevels,
             start_groups: int = 1, tick_s: float = 15.0, warmup_s: float = 45.0, drain_s: float = 10.0) -> Run:
    ready_at = {i: 0.0 for i in range(start_groups)}  # group → when it serves
    leaving: dict[int, float] = {}  # group → when it is gone
    history: dict[int, list[ServiceSample]] = {}  # group → its scrapes over the scale-down window, as the feed keeps
    status: dict = {}
    run = Run()
    step = 0
    t = tick_s
    while t <= seconds:
        for index, gone in list(leaving.items()):
            if gone <= t:
                del leaving[index], ready_at[index]
                history.pop(index, None)
        serving = [i for i, at in ready_at.items() if at <= t and i not in leaving]
        warming = [i for i, at in ready_at.items() if at > t]
        for index in serving:
            per_group = offered(t) / len(serving)
            kept = history.setdefault(index, [ServiceSample(t - tick_s, (), (), 0.0, 0.0, ())])
            kept.append(levels.next_sample(kept[-1], per_group, step + index, t))
            span = policy.scale_down_window_seconds + tick_s
            history[index] = [s for i, s in enumerate(kept) if s.at >= t - span or i >= len(kept) - 2]
        load = load_of({i: history[i] for i in serving}) if serving else None
        step += 1
        groups = Groups(serving=len(serving) + len(warming), warming=len(warming), draining=len(leaving))
        decision = decide(policy, load, status, groups, replicas=start_groups, now=t)
        status = decision.status
        if decision.event:
            run.events.append((t, decision.event[1], decision.event[2]))
        current = sorted(i for i in ready_at if i not in leaving)
        for _ in range(decision.desired - len(current)):
            index = next(i for i in range(1000) if i not in ready_at)
            ready_at[index] = t + warmup_s
        for index in sorted(current, reverse=True)[:max(0, len(current) - decision.desired)]:
            leaving[index] = t + drain_s
        run.ticks.append({"t": t, "offered": offered(t), "desired": decision.desired, "serving": len(serving),
                          "reason": status["reason"], "observed": status.get("observed")})
        t += tick_s
    return run


def steps(*phases: tuple[float, float]) -> Callable[[float], float]:
    """Offered streams from (until_s, streams) phases; the last phase lasts forever."""
    def offered(t: float) -> float:
        for until, streams in phases:
            if t < until:
                return streams
        return phases[-1][1]
    return offered


def square(low: float, high: float, half_period_s: float) -> Callable[[float], float]:
    return lambda t: high if int(t // half_period_s) % 2 else low
