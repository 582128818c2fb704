"""Prometheus series fed by profiled steps and by runner/connector/graph counters.

Labels stay bounded: role, rank, layer, direction, reason — never peer × layer, never
request ids. Per-layer histograms carry few buckets (docs/metrics.md).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LAYER_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.5)


class LayerMetrics:
    """`afd_layer_compute_seconds{layer}` and `afd_transfer_seconds{layer,direction}` for one rank."""

    def __init__(self, registry: CollectorRegistry, role: str, rank: int):
        labels = {"role": role, "rank": str(rank)}
        self._labels = labels
        self.compute = Histogram("afd_layer_compute_seconds", "Compute time of one layer in a profiled step",
                                 [*labels, "layer"], registry=registry, buckets=LAYER_BUCKETS)
        self.transfer = Histogram("afd_transfer_seconds", "Time a layer spent sending to or waiting for the peer in a profiled step",
                                  [*labels, "layer", "direction"], registry=registry, buckets=LAYER_BUCKETS)

    def observe(self, timings: list[tuple[str, int, float]]) -> None:
        """Per-layer sums over stages of one profiled step."""
        totals: dict[tuple[str, int], float] = {}
        for kind, layer, seconds in timings:
            totals[(kind, layer)] = totals.get((kind, layer), 0.0) + seconds
        for (kind, layer), seconds in totals.items():
            if kind == "compute":
                self.compute.labels(**self._labels, layer=str(layer)).observe(seconds)
            else:
                self.transfer.labels(**self._labels, layer=str(layer), direction=kind).observe(seconds)


class RunnerCollector:
    """Reads counters kept as plain ints by the runner at scrape time (nothing on the hot path)."""

    def __init__(self, registry: CollectorRegistry, role: str, rank: int, runner, link_state=None):
        self.labels = {"role": role, "rank": str(rank)}
        self.runner = runner
        self.link_state = link_state  # attention: () -> (ffn rank, up, reconnects, failed reconnects)
        registry.register(self)

    def describe(self):
        return []

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        sent = CounterMetricFamily("afd_transfer_bytes", "Bytes moved between attention and FFN", labels=[*names, "direction"])
        for direction, count in {"send": 0, "recv": 0, **getattr(self.runner, "transfer_bytes", {})}.items():
            sent.add_metric([*values, direction], count)
        yield sent
        graphs = getattr(self.runner, "graphs", None)
        replays = CounterMetricFamily("afd_graph_replays", "Steps served by replaying CUDA graphs (decode graphs, "
                                      "or the piecewise graphs of a prompt step)", labels=names)
        mixed = getattr(self.runner, "mixed_graphs", None)
        replays.add_metric(values, sum(getattr(g, "replays", 0) for g in (graphs, mixed) if g is not None))
        yield replays
        eager = CounterMetricFamily("afd_graph_eager_steps", "Steps run eagerly while graphs were on, by reason",
                                    labels=[*names, "reason"])
        for reason, count in _eager_reasons(self.runner).items():
            eager.add_metric([*values, reason], count)
        yield eager
        memory = GaugeMetricFamily("afd_graph_memory_bytes", "Device memory held by captured graphs", labels=names)
        memory.add_metric(values, getattr(graphs, "memory_bytes", 0) if graphs is not None else 0)
        yield memory
        capture = GaugeMetricFamily("afd_graph_capture_seconds", "Wall time of the last warm-up and capture", labels=names)
        capture.add_metric(values, getattr(self.runner, "capture_seconds", 0.0))
        yield capture
        if self.link_state is not None:
            ffn_rank, up, reconnects, failures = self.link_state()
            peer_up = GaugeMetricFamily("afd_peer_up", "1 while the peer is connected", labels=[*names, "peer"])
            peer_up.add_metric([*values, str(ffn_rank)], 1 if up else 0)
            yield peer_up
            again = CounterMetricFamily("afd_peer_reconnects", "Re-handshakes after a lost peer", labels=names)
            again.add_metric(values, reconnects)
            yield again
            failed = CounterMetricFamily("afd_peer_reconnect_failures", "Re-handshake attempts that failed (the peer not back yet, "
                                         "or refused)", labels=names)
            failed.add_metric(values, failures)
            yield failed


# Every reason a runner can report, exported at 0 until it happens (dashboards show 0, not "No data").
FFN_EAGER_REASONS = ("no_graph", "warmup", "plan_eager", "mixed_plans")
ATTENTION_EAGER_REASONS = ("no_graph", "profile")


def _eager_reasons(runner) -> dict[str, int]:
    graphs = getattr(runner, "graphs", None)
    if graphs is None:  # CUDA graphs off (CPU, zmq, or not configured): every step is eager
        steps = getattr(runner, "steps_run", None)
        return {"graphs_off": steps if steps is not None else getattr(runner, "step_id", 0)}
    reasons = getattr(graphs, "eager_steps", None) if graphs is not None else None
    if isinstance(reasons, dict):
        return {**dict.fromkeys(FFN_EAGER_REASONS, 0), **reasons}
    profiled = getattr(runner, "profiled_eager_steps", 0)
    other = getattr(runner, "eager_steps", 0) - profiled
    return {"no_graph": max(other, 0), "profile": profiled}
