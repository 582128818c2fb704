"""Dashboards and alerts against reality: generated from code, promtool-tested, and every query
run against a real Prometheus scraping a local `afd up` deployment under traffic."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "afd-operator"
PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (Debian package prometheus; .ci/run installs it)")
VARIABLES = {"$namespace": ".*", "$deployment": ".*", "$group": ".*", "$role": ".*", "$rank": ".*", "$__rate_interval": "30s"}


def dashboards() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted((CHART / "dashboards").glob("*.json"))}


def queries(board: dict) -> list[tuple[str, str]]:
    result = []
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            result.append((panel["title"], expr))
    return result


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())["groups"] for rule in group["rules"]]


def test_dashboards_are_generated_from_code():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_dashboards.py"), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    boards = dashboards()
    assert set(boards) == {"afd-overview", "afd-layers", "afd-connector", "afd-operator"}
    for board in boards.values():
        names = [v["name"] for v in board["templating"]["list"]]
        assert names[0] == "datasource"
        if board["uid"] != "afd-operator":
            assert names == ["datasource", "namespace", "deployment", "group", "role", "rank"]
        assert all(p["datasource"]["uid"] == "${datasource}" for p in board["panels"])


@needs_promtool
def test_alert_rules_check_and_unit_tests():
    files = CHART / "files"
    check = subprocess.run([PROMTOOL, "check", "rules", str(files / "alerts.yaml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([PROMTOOL, "test", "rules", "alerts.test.yaml"], cwd=files, capture_output=True, text=True)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr
    assert {r["alert"] for r in alert_rules()} >= {"AFDPeerDown", "AFDStepTimeRegression", "AFDFFNSaturated", "AFDRankRestarts"}


def test_no_alert_or_panel_reads_step_wall_time_as_busy_time():
    """Issue 35: an FFN step's wall time holds its wait for attention, so the rate of its sum is no
    busy share (it read 0.97 on an FFN computing 20% of the time). Busy shares come from compute."""
    exprs = [("alert " + rule["alert"], rule["expr"]) for rule in alert_rules()]
    exprs += [(f"{name}: {title}", expr) for name, board in dashboards().items() for title, expr in queries(board)]
    assert not [where for where, expr in exprs if "afd_step_duration_seconds_sum" in expr]
    saturated = next(rule["expr"] for rule in alert_rules() if rule["alert"] == "AFDFFNSaturated")
    assert "afd_layer_compute_seconds_sum" in saturated and "afd_ffn_steps_total" in saturated


@needs_promtool
def test_the_time_ratio_panel_compares_one_rank_of_each_role(tmp_path):
    """Issue 36: two attention ranks of 40 ms a profiled step over one FFN rank of 20 ms read 2, as one
    such attention rank does; the total over the ranks (the old expression) read 4. Groups apart."""
    panel = next(p for p in dashboards()["afd-layers"]["panels"] if p["title"].startswith("Attention / FFN time ratio"))
    expr = panel["targets"][0]["expr"].replace("$__rate_interval", "5m")
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    series = []
    for group, ranks, attention_ms in (("0", ("0", "1"), 20), ("1", ("0",), 10)):  # per layer and profiled step
        where = f'namespace="ns", afd_io_name="demo", afd_io_group="{group}"'
        for role, rank, ms in [("attention", rank, attention_ms) for rank in ranks] + [("ffn", "0", 10)]:
            for layer in ("0", "1"):  # 10 profiled steps a minute on every rank
                labels = f'{where}, role="{role}", rank="{rank}", layer="{layer}"'
                series += [{"series": f"afd_layer_compute_seconds_sum{{{labels}}}", "values": f"0+{ms / 100}x20"},
                           {"series": f"afd_layer_compute_seconds_count{{{labels}}}", "values": "0+10x20"}]
    want = [{"labels": f'{{namespace="ns", afd_io_name="demo", afd_io_group="{group}"}}', "value": value}
            for group, value in (("0", 2), ("1", 1))]
    (tmp_path / "ratio.test.yaml").write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": series,
         "promql_expr_test": [{"expr": expr, "eval_time": "15m", "exp_samples": want}]}]}))
    unit = subprocess.run([PROMTOOL, "test", "rules", "ratio.test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def _traffic(api: str, model: str, stop: threading.Event) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            client.post(f"{api}/completions", json={"model": model, "prompt": "Hello", "max_tokens": 24, "ignore_eos": True})


def _prometheus_config(state: dict, path: Path) -> None:
    targets = [rank["metrics"].removeprefix("http://").removesuffix("/metrics") for rank in state["ranks"]]
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "afd", "static_configs": [
                  {"targets": targets, "labels": {"namespace": "local", "afd_io_name": "up", "afd_io_group": "0"}}]}]}
    path.write_text(yaml.safe_dump(config))


@pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None, reason="prometheus/promtool missing (Debian package prometheus)")
@pytest.mark.timeout(400)
def test_every_dashboard_query_and_alert_runs_against_a_live_deployment(tmp_path):
    import zmq

    from afd.local.children import free_port_block
    from tests.server.test_up import read_state, wait_for

    up_port, prom_port = free_port_block(1), free_port_block(1)
    state_file = tmp_path / "state.json"
    env = {**os.environ, "AFD_TEST_MARKER": uuid.uuid4().hex, "AFD_CACHE_DIR": str(tmp_path / "cache"), "AFD_PROFILE_EVERY": "4"}
    up = subprocess.Popen([sys.executable, "-m", "afd", "up", "--port", str(up_port), "--state-file", str(state_file),
                           "--no-demo"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prometheus, stop = None, threading.Event()
    try:
        state = wait_for(lambda: read_state(state_file), 240, "afd up")
        for rank in state["ranks"]:  # every rank's exposition is valid
            text = httpx.get(rank["metrics"]).text
            check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True)
            assert check.returncode == 0, check.stdout + check.stderr
        model = httpx.get(f"{state['api']}/models").json()["data"][0]["id"]
        ffn = next(rank for rank in state["ranks"] if rank["role"] == "ffn")
        with zmq.Context() as context, context.socket(zmq.DEALER) as intruder:  # one rejected message, counted
            intruder.connect(ffn["data"])
            intruder.send_multipart([b"not a header", b"x"])
            time.sleep(0.2)
        traffic = [threading.Thread(target=_traffic, args=(state["api"], model, stop)) for _ in range(4)]
        for worker in traffic:
            worker.start()
        _prometheus_config(state, tmp_path / "prometheus.yml")
        prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        api = f"http://127.0.0.1:{prom_port}/api/v1/query"
        wait_for(lambda: _query(api, "sum(afd_layer_compute_seconds_count)"), 60, "prometheus to scrape")
        time.sleep(35)  # enough samples for the 30 s rate windows

        empty = []
        for name, board in dashboards().items():
            for title, expr in queries(board):
                body = httpx.get(api, params={"query": expr}).json()
                assert body["status"] == "success", (name, title, expr, body)
                if not body["data"]["result"] and name != "afd-operator":  # no operator runs in this test
                    empty.append((name, title, expr))
        assert not empty, f"dashboard queries without data: {empty}"
        layers = _query(api, 'count by (role, rank) (afd_layer_compute_seconds_count)')
        crossing = {(row["metric"]["role"], row["metric"]["rank"]): int(row["value"][1]) for row in layers}
        assert crossing == {("attention", "0"): 4, ("attention", "1"): 4, ("ffn", "0"): 4}  # every crossing layer, every rank
        means = _query(api, "rate(afd_layer_compute_seconds_sum[30s]) / rate(afd_layer_compute_seconds_count[30s])")
        assert means and all(0 < float(row["value"][1]) < 1 for row in means)  # plausible per-layer seconds
        for rule in alert_rules():
            body = httpx.get(api, params={"query": rule["expr"]}).json()
            assert body["status"] == "success", (rule["alert"], body)
        assert _query(api, "afd_rejected_messages_total") and not _query(api, "afd_peer_up == 0")
    finally:
        stop.set()
        if prometheus:
            prometheus.send_signal(signal.SIGTERM)
            prometheus.wait(timeout=30)
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)


def _query(api: str, expr: str) -> list:
    try:
        body = httpx.get(api, params={"query": expr}, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return []
    return body.get("data", {}).get("result", []) if body.get("status") == "success" else []


def test_chart_renders_the_alerts_as_a_prometheus_rule():
    from helm_python import Chart

    rendered = Chart.load(str(CHART)).render({"alerts": {"enabled": True, "labels": {"release": "kps"}}}, name="afd", namespace="ops")
    text = "\n---\n".join(v for k, v in rendered.items() if k.endswith(".yaml"))
    rules = [doc for doc in yaml.safe_load_all(text) if doc and doc.get("kind") == "PrometheusRule"]
    assert len(rules) == 1 and rules[0]["metadata"]["labels"]["release"] == "kps"
    assert rules[0]["spec"] == yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    off = Chart.load(str(CHART)).render({}, name="afd", namespace="ops")
    assert not any("PrometheusRule" in v for k, v in off.items() if k.endswith(".yaml"))


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus missing (Debian package prometheus; .ci/run installs it)")
def test_every_operator_dashboard_query_runs_against_the_operators_metrics(tmp_path):
    """A real Prometheus scrapes the operator's /metrics after a reconcile that wrote status.ratio and
    status.autoscaling; every query of the operator dashboard (the spec.ratio and spec.autoscaling
    panels included) returns data."""
    from afd.local.children import free_port_block
    from afd_operator.metrics import OperatorMetrics, serve_metrics

    metrics = OperatorMetrics()
    ratio = {"current": "2A1F", "recommended": "4A1F", "predictedGainPercent": 22,
             "groups": [{"index": 0, "attentionBusyPercent": 70, "ffnBusyPercent": 12}]}
    metrics.observe("ns", "demo", 0.02, "api", {"replicas": 1}, None)
    spec = {"replicas": 1, "autoscaling": {"enabled": True, "targets": {"ttftP90Seconds": 1.0}}}
    scaled = {"desiredGroups": 2, "currentGroups": 1, "lastDecisionTime": "2026-01-01T00:01:00Z",
              "observed": {"ttftP90Seconds": 1.6, "concurrencyPerGroup": 9.0}}
    for state in ({**scaled, "desiredGroups": 1, "lastDecisionTime": None}, scaled):  # one scale-up decision
        metrics.observe("ns", "demo", 0.02, None, spec, {"readyReplicas": 1, "ratio": ratio, "autoscaling": state})
    exporter, prom_port = serve_metrics(0, metrics, address="127.0.0.1"), free_port_block(1)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": "operator", "static_configs": [{"targets": [f"127.0.0.1:{exporter.server_port}"],
                                                     "labels": {"namespace": "ns"}}]}]}))
    prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        api = f"http://127.0.0.1:{prom_port}/api/v1/query"
        started = time.monotonic()
        while time.monotonic() - started < 10 or not _query(api, "afd_operator_reconcile_total"):
            assert time.monotonic() - started < 60, "prometheus did not scrape the operator"
            time.sleep(1)  # the rate() panels need a few scrapes of moving counters
            metrics.observe("ns", "demo", 0.02, None, spec, {"readyReplicas": 1, "ratio": ratio, "autoscaling": scaled})
        empty = [title for title, expr in queries(dashboards()["afd-operator"]) if not _query(api, expr)]
        assert not empty, f"operator dashboard panels without data: {empty}"
        shares = {row["metric"]["side"]: float(row["value"][1])
                  for row in _query(api, "afd_operator_ratio_busy_ratio")}
        assert shares == {"attention": 0.7, "ffn": 0.12}
    finally:
        prometheus.send_signal(signal.SIGTERM)
        prometheus.wait(timeout=30)
        exporter.shutdown()


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus missing (Debian package prometheus; .ci/run installs it)")
def test_the_operators_monitors_keep_each_deployments_namespace(tmp_path):
    """Issue 35: a real Prometheus scrapes the operator as the chart's ServiceMonitor and PodMonitor
    tell it (honorLabels → honor_labels; the target's `namespace` is the operator pod's, as the
    Prometheus Operator sets it). The AFDDeployment's namespace survives, so the operator
    dashboard's namespace filter finds its series, and nothing is renamed to exported_namespace."""
    from chartkit import ALL_FEATURES, NAMESPACE, one, render_objects

    from afd.local.children import free_port_block
    from afd_operator.metrics import OperatorMetrics, serve_metrics

    objs = render_objects(ALL_FEATURES)
    endpoints = {"servicemonitor": one(objs, "ServiceMonitor")["spec"]["endpoints"][0],
                 "podmonitor": one(objs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]}
    metrics = OperatorMetrics()
    exporter, prom_port = serve_metrics(0, metrics, address="127.0.0.1"), free_port_block(1)
    target = f"127.0.0.1:{exporter.server_port}"
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": job, "honor_labels": endpoint.get("honorLabels", False), "metrics_path": endpoint["path"],
         "static_configs": [{"targets": [target], "labels": {"namespace": NAMESPACE}}]}
        for job, endpoint in endpoints.items()]}))
    prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        api = f"http://127.0.0.1:{prom_port}/api/v1/query"
        started = time.monotonic()
        while len(_query(api, "count by (job) (afd_operator_reconcile_total)")) < 2:
            assert time.monotonic() - started < 60, "prometheus did not scrape the operator"
            metrics.observe("team-a", "demo", 0.02, None, {"replicas": 1}, {"readyReplicas": 1})
            time.sleep(1)
        found = {row["metric"]["job"] for row in _query(api, 'afd_operator_reconcile_total{namespace="team-a"}')}
        assert found == set(endpoints), _query(api, "afd_operator_reconcile_total")
        assert not _query(api, '{exported_namespace!=""}')
        groups = [expr for title, expr in queries(dashboards()["afd-operator"]) if "afd_operator_groups" in expr]
        assert groups and all(_query(api, expr.replace(".*", "team-a")) for expr in groups)
    finally:
        prometheus.send_signal(signal.SIGTERM)
        prometheus.wait(timeout=30)
        exporter.shutdown()
