"""The operator's own Prometheus metrics (`afd operator --metrics-port`).

Counters keep `_total`; labels are bounded by the resources that exist (namespace,
deployment, group) plus small fixed sets (`result`, `reason`, `state`, `side`, `topology`). Series of a deleted resource are
removed, so a churn of short-lived resources does not grow the exposition forever.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge,
                               Histogram, start_http_server)

from afd.config.topology import Topology, TopologyError

log = logging.getLogger(__name__)

LABELS = ("namespace", "deployment")
RESULTS = ("success", "error")
ERROR_REASONS = ("api", "invalid_spec", "internal")
GROUP_STATES = ("desired", "ready", "failed")
RATIO_TOPOLOGIES = ("current", "recommended")
SIDES = ("attention", "ffn")
AUTOSCALE_STATES = ("desired", "current")
DIRECTIONS = ("up", "down")
SIGNALS = ("ttftP90Seconds", "itlP90Seconds", "waitingPerGroup", "kvCacheUsage", "concurrencyPerGroup")
# Reconciles are API round trips: milliseconds to tens of seconds under a slow API server.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class OperatorMetrics:
    """Reconcile counts, errors and durations, and groups per state, per AFDDeployment."""

    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.reconciles = Counter(
            "afd_operator_reconcile", "Reconciles of an AFDDeployment by result (success or error).",
            (*LABELS, "result"), registry=self.registry)
        self.errors = Counter(
            "afd_operator_reconcile_errors",
            "Reconciles that failed: api (the Kubernetes API refused or did not answer), invalid_spec "
            "(the spec cannot be acted on; nothing applied), internal (a bug: see the operator log).",
            (*LABELS, "reason"), registry=self.registry)
        self.duration = Histogram(
            "afd_operator_reconcile_duration_seconds", "Time one reconcile took, API calls included.",
            LABELS, buckets=DURATION_BUCKETS, registry=self.registry)
        self.groups = Gauge(
            "afd_operator_groups",
            "AFD groups of an AFDDeployment: desired (spec.replicas, or the autoscaler's count), ready (every rank Ready), "
            "failed (restart budget spent).",
            (*LABELS, "state"), registry=self.registry)
        self.ratio = Gauge(
            "afd_operator_ratio_attention_per_ffn",
            "spec.ratio: attention ranks per FFN rank of the groups now (current) and of the recommendation "
            "(recommended; absent when there is none).", (*LABELS, "topology"), registry=self.registry)
        self.gain = Gauge(
            "afd_operator_ratio_predicted_gain_ratio",
            "spec.ratio: predicted tokens/s per GPU of the recommended topology over the current one, minus 1.",
            LABELS, registry=self.registry)
        self.busy = Gauge(
            "afd_operator_ratio_busy_ratio",
            "spec.ratio: share of a decode step each side computes, per group, from the fitted cost model.",
            (*LABELS, "group", "side"), registry=self.registry)
        self._busy_groups: dict[tuple[str, str], set[str]] = {}
        self.autoscale_groups = Gauge(
            "afd_operator_autoscale_groups",
            "spec.autoscaling: the group count it wants (desired) and the groups serving now, leaving ones "
            "excluded (current).", (*LABELS, "state"), registry=self.registry)
        self.autoscale_decisions = Counter(
            "afd_operator_autoscale_decisions",
            "spec.autoscaling: changes of the desired group count, by direction (up or down).",
            (*LABELS, "direction"), registry=self.registry)
        self.autoscale_signal = Gauge(
            "afd_operator_autoscale_signal",
            "spec.autoscaling: each signal at the last evaluation (TTFT and ITL p90 in seconds, waiting and "
            "in-flight requests per group, KV-cache use as a ratio).", (*LABELS, "signal"), registry=self.registry)
        self.autoscale_target = Gauge(
            "afd_operator_autoscale_target",
            "spec.autoscaling: the target of each signal that has one.", (*LABELS, "signal"), registry=self.registry)
        self._decisions: dict[tuple[str, str], tuple[Any, Any]] = {}

    def observe(self, namespace: str, name: str, seconds: float, error: Optional[str],
                spec: Mapping[str, Any], status: Optional[Mapping[str, Any]]) -> None:
        """Record one reconcile: its duration, its error reason (None: success) and, when a
        status came out of it, the group counts it reports."""
        self.reconciles.labels(namespace, name, "success" if error is None else "error").inc()
        self.duration.labels(namespace, name).observe(seconds)
        if error is not None:
            self.errors.labels(namespace, name, error).inc()
        if status is None:
            return
        desired = (status.get("autoscaling") or {}).get("desiredGroups", spec.get("replicas", 1))
        if isinstance(desired, int):
            self.groups.labels(namespace, name, "desired").set(desired)
        if "readyReplicas" in status:
            self.groups.labels(namespace, name, "ready").set(status["readyReplicas"])
            failed = sum(1 for g in status.get("groups") or [] if g.get("phase") == "Failed")
            self.groups.labels(namespace, name, "failed").set(failed)
        self._observe_ratio(namespace, name, status.get("ratio"))
        self._observe_autoscaling(namespace, name, status.get("autoscaling"), spec)

    def _observe_autoscaling(self, namespace: str, name: str, state: Optional[Mapping[str, Any]],
                             spec: Mapping[str, Any]) -> None:
        """status.autoscaling → its gauges; a new lastDecisionTime counts a decision."""
        key = (namespace, name)
        if not state:
            for which in AUTOSCALE_STATES:
                _remove(self.autoscale_groups, namespace, name, which)
            for signal in SIGNALS:
                _remove(self.autoscale_signal, namespace, name, signal)
                _remove(self.autoscale_target, namespace, name, signal)
            self._decisions.pop(key, None)
            return
        self.autoscale_groups.labels(namespace, name, "desired").set(state.get("desiredGroups", 0))
        self.autoscale_groups.labels(namespace, name, "current").set(state.get("currentGroups", 0))
        observed = state.get("observed") or {}
        targets = ((spec.get("autoscaling") or {}).get("targets")) or {}
        for signal in SIGNALS:
            for gauge, value in ((self.autoscale_signal, observed.get(signal)), (self.autoscale_target, targets.get(signal))):
                if isinstance(value, (int, float)):
                    gauge.labels(namespace, name, signal).set(value)
                else:
                    _remove(gauge, namespace, name, signal)
        stamp = (state.get("lastDecisionTime"), state.get("desiredGroups"))
        last = self._decisions.get(key)
        if last is not None and stamp[0] and stamp[0] != last[0] and stamp[1] != last[1]:
            self.autoscale_decisions.labels(namespace, name, "up" if stamp[1] > last[1] else "down").inc()
        self._decisions[key] = stamp

    def _observe_ratio(self, namespace: str, name: str, ratio: Optional[Mapping[str, Any]]) -> None:
        """status.ratio → the ratio gauges; series that no longer apply are removed."""
        ratio = ratio or {}
        for which in RATIO_TOPOLOGIES:
            value = _per_ffn(ratio.get(which))
            if value is None:
                _remove(self.ratio, namespace, name, which)
            else:
                self.ratio.labels(namespace, name, which).set(value)
        if ratio.get("predictedGainPercent") is not None:  # null: written to remove it
            self.gain.labels(namespace, name).set(ratio["predictedGainPercent"] / 100)
        else:
            _remove(self.gain, namespace, name)
        groups = {str(g["index"]): g for g in ratio.get("groups") or [] if "attentionBusyPercent" in g}
        for gone in self._busy_groups.get((namespace, name), set()) - set(groups):
            for side in SIDES:
                _remove(self.busy, namespace, name, gone, side)
        for index, g in groups.items():
            self.busy.labels(namespace, name, index, "attention").set(g["attentionBusyPercent"] / 100)
            self.busy.labels(namespace, name, index, "ffn").set(g["ffnBusyPercent"] / 100)
        self._busy_groups[(namespace, name)] = set(groups)

    def forget(self, namespace: str, name: str) -> None:
        """Drop every series of a deleted AFDDeployment."""
        for metric, extra in ((self.reconciles, [(r,) for r in RESULTS]), (self.duration, [()]),
                              (self.errors, [(r,) for r in ERROR_REASONS]),
                              (self.groups, [(s,) for s in GROUP_STATES]),
                              (self.autoscale_decisions, [(d,) for d in DIRECTIONS])):
            for values in extra:
                _remove(metric, namespace, name, *values)
        self._observe_ratio(namespace, name, None)
        self._observe_autoscaling(namespace, name, None, {})
        self._busy_groups.pop((namespace, name), None)


def _remove(metric: Any, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass


def _per_ffn(topology: Optional[str]) -> Optional[float]:
    try:
        shape = Topology.parse(topology) if topology else None
    except TopologyError:
        return None
    return shape.num_attention / shape.num_ffn if shape else None


def serve_metrics(port: int, metrics: OperatorMetrics, address: str = "0.0.0.0") -> Any:
    """Serve /metrics on `port` (a daemon thread), with the process's own collectors too."""
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        try:
            metrics.registry.register(collector)
        except ValueError:  # already registered (a second call)
            pass
    server, _thread = start_http_server(port, addr=address, registry=metrics.registry)
    log.info("operator metrics on http://%s:%d/metrics", address, server.server_port)
    return server
