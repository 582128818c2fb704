"""The operator's own Prometheus metrics (`afd operator --metrics-port`).

Counters keep `_total`; labels are bounded by the resources that exist (namespace,
deployment) plus small fixed sets (`result`, `reason`, `state`). Series of a deleted resource are
removed, so a churn of short-lived resources does not grow the exposition forever.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger(__name__)

LABELS = ("namespace", "deployment")
RESULTS = ("success", "error")
ERROR_REASONS = ("api", "invalid_spec", "internal")
GROUP_STATES = ("desired", "ready", "failed")
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
            "AFD groups of an AFDDeployment: desired (spec.replicas), ready (every rank Ready), "
            "failed (restart budget spent).",
            (*LABELS, "state"), registry=self.registry)

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
        desired = spec.get("replicas", 1)
        if isinstance(desired, int):
            self.groups.labels(namespace, name, "desired").set(desired)
        if "readyReplicas" in status:
            self.groups.labels(namespace, name, "ready").set(status["readyReplicas"])
            failed = sum(1 for g in status.get("groups") or [] if g.get("phase") == "Failed")
            self.groups.labels(namespace, name, "failed").set(failed)

    def forget(self, namespace: str, name: str) -> None:
        """Drop every series of a deleted AFDDeployment."""
        for metric, extra in ((self.reconciles, [(r,) for r in RESULTS]), (self.duration, [()]),
                              (self.errors, [(r,) for r in ERROR_REASONS]),
                              (self.groups, [(s,) for s in GROUP_STATES])):
            for values in extra:
                try:
                    metric.remove(namespace, name, *values)
                except KeyError:
                    pass


def serve_metrics(port: int, metrics: OperatorMetrics, address: str = "0.0.0.0") -> Any:
    """Serve /metrics on `port` (a daemon thread), with the process's own collectors too."""
    from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, start_http_server

    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        try:
            metrics.registry.register(collector)
        except ValueError:  # already registered (a second call)
            pass
    server, _thread = start_http_server(port, addr=address, registry=metrics.registry)
    log.info("operator metrics on http://%s:%d/metrics", address, server.server_port)
    return server
