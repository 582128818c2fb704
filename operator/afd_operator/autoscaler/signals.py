"""The attention ranks' serving series → the service-level signals spec.autoscaling judges. Pure.

One scrape of a group (every attention rank's /metrics, or the same series from Prometheus)
becomes a `ServiceSample`: the time-to-first-token and inter-token-latency histograms summed
over the ranks (cumulative bucket counts), and the gauges of requests running and waiting and
of KV-cache use. Each serving group's recent scrapes make a `Load`: the 90th percentiles over the
interval between the last two (the way Prometheus' `histogram_quantile` reads a rate of buckets)
and over the whole span kept (the scale-down window: one slow interval does not outweigh it), the
waiting requests and running + waiting requests per group, and the mean KV-cache use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from prometheus_client.parser import text_string_to_metric_families

TTFT = "afd_time_to_first_token_seconds"
ITL = "afd_inter_token_latency_seconds"
RUNNING, WAITING, KV_USAGE = "afd_requests_running", "afd_requests_waiting", "afd_kv_cache_usage_ratio"
# what a Prometheus query must return for one group (exposition names)
SERIES = (f"{TTFT}_bucket", f"{ITL}_bucket", RUNNING, WAITING, KV_USAGE)
QUANTILE = 0.9

Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending, +Inf last


@dataclass(frozen=True)
class ServiceSample:
    """One group's attention ranks at one time."""

    at: float
    ttft: Buckets
    itl: Buckets
    running: float
    waiting: float
    kv_usage: tuple[float, ...]  # per attention rank

    @property
    def in_flight(self) -> float:
        return self.running + self.waiting


@dataclass(frozen=True)
class Load:
    """The deployment's service levels over one interval, over the groups that served in it."""

    at: float
    groups: int
    ttft_p90: Optional[float]  # None: no request got its first token in the interval
    itl_p90: Optional[float]  # None: no token followed another
    waiting_per_group: float
    concurrency_per_group: float  # running + waiting requests per group
    kv_usage: float  # mean over the attention ranks
    in_flight: dict[int, float] = field(default_factory=dict)  # group → running + waiting now
    ttft_p90_span: Optional[float] = None  # over every scrape kept, not only the last interval
    itl_p90_span: Optional[float] = None

    def signals(self) -> dict[str, float]:
        """The measured signals, named as spec.autoscaling.targets names them."""
        values = {"ttftP90Seconds": self.ttft_p90, "itlP90Seconds": self.itl_p90,
                  "waitingPerGroup": self.waiting_per_group, "kvCacheUsage": self.kv_usage}
        return {k: v for k, v in values.items() if v is not None}


def parse_service(text: str, at: float) -> Optional[ServiceSample]:
    """The serving series of the attention ranks in one exposition; None when it has none."""
    ttft: dict[float, float] = {}
    itl: dict[float, float] = {}
    gauges = {RUNNING: 0.0, WAITING: 0.0}
    kv: dict[str, float] = {}
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if labels.get("role") != "attention":
                continue
            if sample.name in (f"{TTFT}_bucket", f"{ITL}_bucket"):
                target = ttft if sample.name.startswith(TTFT) else itl
                bound = float(labels["le"])
                target[bound] = target.get(bound, 0.0) + sample.value
            elif sample.name in gauges:
                gauges[sample.name] += sample.value
            elif sample.name == KV_USAGE:
                kv[labels.get("rank", "")] = sample.value
            else:
                continue
            seen = True
    if not seen:
        return None
    return ServiceSample(at, tuple(sorted(ttft.items())), tuple(sorted(itl.items())), gauges[RUNNING],
                         gauges[WAITING], tuple(v for _, v in sorted(kv.items())))


def quantile(q: float, buckets: Buckets) -> Optional[float]:
    """The q-quantile of a histogram's bucket counts, interpolated linearly inside the bucket
    (Prometheus' histogram_quantile); the highest finite bound when it falls in +Inf; None when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def delta(after: Buckets, before: Buckets) -> Buckets:
    """Bucket counts added between two scrapes (a counter reset, e.g. a restarted rank, counts from 0)."""
    old = dict(before)
    diffs = [(bound, count - old.get(bound, 0.0)) for bound, count in after]
    if any(d < 0 for _, d in diffs):
        return after
    return tuple(diffs)


def merge(histograms: list[Buckets]) -> Buckets:
    total: dict[float, float] = {}
    for buckets in histograms:
        for bound, count in buckets:
            total[bound] = total.get(bound, 0.0) + count
    return tuple(sorted(total.items()))


def load_of(history: Mapping[int, Sequence[ServiceSample]]) -> Optional[Load]:
    """The Load of the groups: group → its scrapes, oldest first (at least two each). None without groups."""
    if not history:
        return None
    if any(len(samples) < 2 for samples in history.values()):
        raise ValueError("a Load needs at least two scrapes of every group")
    latest = [samples[-1] for samples in history.values()]

    def p90(kind: str, first: int) -> Optional[float]:
        return quantile(QUANTILE, merge([delta(getattr(s[-1], kind), getattr(s[first], kind)) for s in history.values()]))

    kv = [u for s in latest for u in s.kv_usage]
    n = len(history)
    return Load(
        at=max(s.at for s in latest), groups=n,
        ttft_p90=p90("ttft", -2), itl_p90=p90("itl", -2),
        waiting_per_group=sum(s.waiting for s in latest) / n,
        concurrency_per_group=sum(s.in_flight for s in latest) / n,
        kv_usage=sum(kv) / len(kv) if kv else 0.0,
        in_flight={index: samples[-1].in_flight for index, samples in history.items()},
        ttft_p90_span=p90("ttft", 0), itl_p90_span=p90("itl", 0),
    )
