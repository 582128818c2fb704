"""`afd operator --metrics-port`: the flag, the endpoint, and what it exposes."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from afd_operator import cli
from afd_operator.metrics import OperatorMetrics, serve_metrics


def test_the_flag_reaches_the_operator(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "run_operator", lambda *a, **kw: seen.update(args=a, kwargs=kw))
    assert cli.operator_main(["--metrics-port=9191"]) == 0
    assert seen["kwargs"]["metrics_port"] == 9191
    assert cli.operator_main([]) == 0 and seen["kwargs"]["metrics_port"] is None  # off by default
    with pytest.raises(SystemExit):
        cli.operator_main(["--metrics-port=70000"])


def _scrape(metrics):
    server = serve_metrics(0, metrics, address="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5) as response:
            return response.read().decode()
    finally:
        server.shutdown()
        server.server_close()


def test_the_endpoint_serves_the_reconcile_and_group_series():
    metrics = OperatorMetrics()
    status = {"readyReplicas": 1, "groups": [{"index": 0, "phase": "Ready"}, {"index": 1, "phase": "Failed"}]}
    metrics.observe("ns", "demo", 0.02, None, {"replicas": 2}, status)
    metrics.observe("ns", "demo", 0.5, "api", {"replicas": 2}, None)
    text = _scrape(metrics)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    key = (("deployment", "demo"), ("namespace", "ns"))
    assert samples[("afd_operator_reconcile_total", key + (("result", "success"),))] == 1
    assert samples[("afd_operator_reconcile_total", key + (("result", "error"),))] == 1
    assert samples[("afd_operator_reconcile_errors_total", key + (("reason", "api"),))] == 1
    assert samples[("afd_operator_reconcile_duration_seconds_count", key)] == 2
    assert samples[("afd_operator_groups", key + (("state", "desired"),))] == 2
    assert samples[("afd_operator_groups", key + (("state", "ready"),))] == 1
    assert samples[("afd_operator_groups", key + (("state", "failed"),))] == 1
    assert "process_cpu_seconds_total" in text or "python_info" in text  # the process collectors too


def test_the_ratio_series_follow_status_ratio_and_go_with_it():
    metrics = OperatorMetrics()
    ratio = {"current": "2A1F", "recommended": "4A1F", "predictedGainPercent": 22,
             "groups": [{"index": 0, "attentionBusyPercent": 70, "ffnBusyPercent": 10}, {"index": 1, "message": "few"}]}
    metrics.observe("ns", "demo", 0.01, None, {}, {"readyReplicas": 1, "ratio": ratio})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(_scrape(metrics)) for s in f.samples if s.name.startswith("afd_operator_ratio")}
    key = (("deployment", "demo"), ("namespace", "ns"))
    assert samples[("afd_operator_ratio_attention_per_ffn", key + (("topology", "current"),))] == 2
    assert samples[("afd_operator_ratio_attention_per_ffn", key + (("topology", "recommended"),))] == 4
    assert samples[("afd_operator_ratio_predicted_gain_ratio", key)] == 0.22
    busy = {dict(labels)["side"]: v for (name, labels), v in samples.items() if name == "afd_operator_ratio_busy_ratio"}
    assert busy == {"attention": 0.7, "ffn": 0.1}  # group 1 has no fit: no series
    metrics.observe("ns", "demo", 0.01, None, {}, {"readyReplicas": 1, "ratio": {
        "current": "4A1F", "recommended": None, "predictedGainPercent": None}})
    left = [s for f in text_string_to_metric_families(_scrape(metrics)) for s in f.samples if s.name.startswith("afd_operator_ratio")]
    assert [(s.labels["topology"], s.value) for s in left] == [("current", 4)]


def test_the_autoscaling_series_count_decisions_and_follow_status_autoscaling():
    metrics = OperatorMetrics()
    spec = {"replicas": 1, "autoscaling": {"enabled": True, "targets": {"ttftP90Seconds": 1.5}}}

    def observe(desired, decided, observed=None):
        state = {"desiredGroups": desired, "currentGroups": 1, "lastDecisionTime": decided,
                 "observed": observed or {"ttftP90Seconds": 2.5, "concurrencyPerGroup": 6.0}}
        metrics.observe("ns", "demo", 0.01, None, spec, {"readyReplicas": 1, "autoscaling": state})

    def samples():
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("namespace", "deployment")))): s.value
                for f in text_string_to_metric_families(_scrape(metrics)) for s in f.samples
                if s.name.startswith(("afd_operator_autoscale", "afd_operator_groups"))}

    observe(1, None)
    observe(2, "2026-01-01T00:00:00Z")  # a scale-up
    observe(2, "2026-01-01T00:00:00Z")  # the same decision seen again
    observe(1, "2026-01-01T00:05:00Z", {"ttftP90Seconds": 0.2})  # a scale-down
    got = samples()
    assert got[("afd_operator_autoscale_decisions_total", (("direction", "up"),))] == 1
    assert got[("afd_operator_autoscale_decisions_total", (("direction", "down"),))] == 1
    assert got[("afd_operator_autoscale_groups", (("state", "desired"),))] == 1
    assert got[("afd_operator_groups", (("state", "desired"),))] == 1
    assert got[("afd_operator_autoscale_signal", (("signal", "ttftP90Seconds"),))] == 0.2
    assert ("afd_operator_autoscale_signal", (("signal", "concurrencyPerGroup"),)) not in got
    assert got[("afd_operator_autoscale_target", (("signal", "ttftP90Seconds"),))] == 1.5
    metrics.observe("ns", "demo", 0.01, None, {"replicas": 3}, {"readyReplicas": 1})  # autoscaling turned off
    assert not [k for k in samples() if k[0].startswith("afd_operator_autoscale_") and "decisions" not in k[0]]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_the_exposition_passes_promtool():
    metrics = OperatorMetrics()
    metrics.observe("ns", "demo", 0.02, "invalid_spec", {"replicas": 1}, {"readyReplicas": 0})
    result = subprocess.run(["promtool", "check", "metrics"], input=_scrape(metrics), capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
