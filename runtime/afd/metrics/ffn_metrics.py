"""Metrics of an FFN rank: steps and rows served (fed by the executor), peers and rejections (read from the link)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from afd.metrics.histogram_buckets import LATENCY_BUCKETS, TOKEN_BUCKETS


def _labels(rank: int) -> dict[str, str]:
    return {"role": "ffn", "rank": str(rank)}


class FFNStepMetrics:
    """Each step's duration and rows; made before the executor, which reports to `on_step`."""

    def __init__(self, registry: CollectorRegistry, rank: int):
        labels = _labels(rank)
        self.step_duration = Histogram("afd_step_duration_seconds", "Wall time of one FFN step", list(labels),
                                       registry=registry, buckets=LATENCY_BUCKETS).labels(**labels)
        self.step_tokens = Histogram("afd_step_tokens", "Rows served in one FFN step (all peers, all layers' batch)",
                                     list(labels), registry=registry, buckets=TOKEN_BUCKETS).labels(**labels)
        self.steps = Counter("afd_ffn_steps", "FFN steps run", list(labels), registry=registry).labels(**labels)

    def on_step(self, seconds: float, rows: int) -> None:
        self.step_duration.observe(seconds)
        self.step_tokens.observe(rows)
        self.steps.inc()


class FFNLinkMetrics:
    """Peers up, rejected messages and refused Hellos of a built FFN link (read at scrape time)."""

    def __init__(self, registry: CollectorRegistry, rank: int, link):
        self._labels = _labels(rank)
        self.peer_up = Gauge("afd_peer_up", "1 while the attention peer is connected", [*self._labels, "peer"],
                             registry=registry)
        self.link = link
        registry.register(self)

    def on_peer(self, attention_rank: int, up: bool) -> None:
        self.peer_up.labels(**self._labels, peer=str(attention_rank)).set(1 if up else 0)

    def collect(self):
        family = CounterMetricFamily("afd_rejected_messages", "Messages rejected by the FFN link",
                                     labels=[*self._labels, "reason"])
        for reason, count in {"control": 0, **self.link.rejected}.items():  # 0 from the start, not "No data"
            family.add_metric([*self._labels.values(), reason], count)
        yield family
        refused = CounterMetricFamily("afd_handshake_failures", "Hellos refused (mismatch, foreign group, unserved rank)",
                                      labels=list(self._labels))
        refused.add_metric(list(self._labels.values()), self.link.handshake_failures)
        yield refused

    def describe(self):
        return []
