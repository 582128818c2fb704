#!/usr/bin/env python3
"""Generate the Grafana dashboards of the chart from code (run after changing a panel).

    python scripts/make_dashboards.py          # rewrite charts/afd-operator/dashboards/*.json
    python scripts/make_dashboards.py --check  # exit 1 if a committed file is stale

Every panel queries metric names the runtime or the operator really exports; the tests
run each query against a real Prometheus scraping a local deployment.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "charts" / "afd-operator" / "dashboards"
SEL = 'namespace=~"$namespace", afd_io_name=~"$deployment", afd_io_group=~"$group", role=~"$role", rank=~"$rank"'
RATE = "$__rate_interval"
ATTENTION, FFN = 'role="attention"', 'role="ffn"'


def sel(extra: str = "") -> str:
    return "{" + SEL + (", " + extra if extra else "") + "}"


def variable(name: str, label: str, metric: str = "afd_step_duration_seconds_count") -> dict:
    return {
        "name": name, "label": label, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": f"label_values({metric}, {label})", "refId": name}, "definition": f"label_values({metric}, {label})",
        "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "refresh": 2,
    }


VARIABLES = [
    {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "current": {}},
    variable("namespace", "namespace"),
    variable("deployment", "afd_io_name"),
    variable("group", "afd_io_group"),
    variable("role", "role"),
    variable("rank", "rank"),
]


def panel(title: str, targets: list[tuple[str, str]], unit: str = "short", kind: str = "timeseries", width: int = 12) -> dict:
    return {
        "type": kind, "title": title, "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "gridPos": {"w": width, "h": 8},
        "targets": [{"refId": chr(65 + i), "expr": expr, "legendFormat": legend} for i, (expr, legend) in enumerate(targets)],
        **({"options": {"calculate": False, "yAxis": {"unit": unit}, "cellGap": 1}} if kind == "heatmap" else {}),
    }


def quantile(q: float, metric: str, by: str = "role", extra: str = "") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{sel(extra)}[{RATE}])))"


def mean(metric: str, by: str, extra: str = "") -> str:
    return (f"sum by ({by}) (rate({metric}_sum{sel(extra)}[{RATE}])) / "
            f"sum by ({by}) (rate({metric}_count{sel(extra)}[{RATE}]))")


def ffn_busy() -> str:
    """Share of the time each FFN process computes (the AFDFFNSaturated signal): the mean compute of
    a profiled step, summed over layers, times the steps per second. Not the step's wall time, which
    also counts the wait for attention."""
    by = "namespace, afd_io_name, afd_io_group, rank, shard"
    return (f"sum by ({by}) (rate(afd_layer_compute_seconds_sum{sel(FFN)}[{RATE}]) / "
            f"rate(afd_layer_compute_seconds_count{sel(FFN)}[{RATE}])) * on ({by}) "
            f"sum by ({by}) (rate(afd_ffn_steps_total{sel(FFN)}[{RATE}]))")


def compute_per_step(role: str, by: str = "namespace, afd_io_name, afd_io_group") -> str:
    """Compute of one profiled step of one rank of `role`, summed over its layers: every rank's compute
    over every rank's profiled steps (the layer observations over the number of layers). A mean over
    the ranks, so more ranks of a role do not make its side look slower."""
    return (f"sum by ({by}) (rate(afd_layer_compute_seconds_sum{sel(role)}[{RATE}])) / "
            f"(sum by ({by}) (rate(afd_layer_compute_seconds_count{sel(role)}[{RATE}])) / "
            f"count by ({by}) (count by ({by}, layer) (afd_layer_compute_seconds_count{sel(role)})))")


def dashboard(uid: str, title: str, panels: list[dict], variables: list[dict] = VARIABLES) -> dict:
    x = y = 0
    for index, item in enumerate(panels):
        item["id"] = index + 1
        if x + item["gridPos"]["w"] > 24:
            x, y = 0, y + 8
        item["gridPos"].update(x=x, y=y)
        x += item["gridPos"]["w"]
    return {"uid": uid, "title": title, "tags": ["afd"], "timezone": "browser", "schemaVersion": 39, "version": 1,
            "refresh": "30s", "time": {"from": "now-1h", "to": "now"}, "templating": {"list": variables}, "panels": panels}


def overview() -> dict:
    return dashboard("afd-overview", "AFD / Overview", [
        panel("Output tokens/s", [(f"sum by (rank) (rate(afd_generation_tokens_total{sel()}[{RATE}]))", "attention {{rank}}")]),
        panel("Requests running / waiting", [(f"sum(afd_requests_running{sel()})", "running"),
                                             (f"sum(afd_requests_waiting{sel()})", "waiting")]),
        panel("Time to first token", [(quantile(0.5, "afd_time_to_first_token_seconds"), "p50"),
                                      (quantile(0.99, "afd_time_to_first_token_seconds"), "p99")], "s"),
        panel("Inter-token latency", [(quantile(0.5, "afd_inter_token_latency_seconds"), "p50"),
                                      (quantile(0.99, "afd_inter_token_latency_seconds"), "p99")], "s"),
        panel("Step time by role (p50, p99)", [(quantile(0.5, "afd_step_duration_seconds"), "{{role}} p50"),
                                               (quantile(0.99, "afd_step_duration_seconds"), "{{role}} p99")], "s"),
        panel("Tokens per step", [(mean("afd_step_tokens", "role"), "{{role}}")]),
        panel("KV-cache usage", [(f"max by (rank) (afd_kv_cache_usage_ratio{sel()})", "attention {{rank}}")], "percentunit"),
        panel("Prefix-cache hit rate (prompt tokens found cached)", [
            (f"sum by (rank) (rate(afd_prefix_cache_hits_total{sel()}[{RATE}])) / "
             f"sum by (rank) (rate(afd_prefix_cache_queries_total{sel()}[{RATE}]))", "attention {{rank}}")], "percentunit"),
        panel("Prompt tokens/s and request errors", [
            (f"sum(rate(afd_prompt_tokens_total{sel()}[{RATE}]))", "prompt tokens/s"),
            (f"sum(rate(afd_request_errors_total{sel()}[{RATE}]))", "errors/s")]),
    ])


def layers() -> dict:
    return dashboard("afd-layers", "AFD / Layers: where each step's time goes", [
        panel("FFN compute per layer (mean of profiled steps)", [(mean("afd_layer_compute_seconds", "layer", 'role="ffn"'), "{{layer}}")],
              "s", "heatmap", 24),
        panel("Attention wait for the FFN per layer", [(mean("afd_transfer_seconds", "layer", 'role="attention", direction="recv"'), "{{layer}}")],
              "s", "heatmap"),
        panel("FFN wait for attention per layer", [(mean("afd_transfer_seconds", "layer", 'role="ffn", direction="recv"'), "{{layer}}")],
              "s", "heatmap"),
        panel("Attention vs FFN compute per profiled step (the A:F signal)", [
            (f"sum by (role) (rate(afd_layer_compute_seconds_sum{sel()}[{RATE}])) / "
             f"(sum by (role) (rate(afd_layer_compute_seconds_count{sel()}[{RATE}])) / "
             f"count by (role) (count by (role, layer) (afd_layer_compute_seconds_count{sel()})))", "{{role}}")], "s"),
        panel("Attention / FFN time ratio per rank and step (> 1.5 attention-bound, < 0.67 FFN-bound)", [
            (f"({compute_per_step(ATTENTION)}) / ({compute_per_step(FFN)})", "{{afd_io_name}} g{{afd_io_group}}")]),
        panel("FFN compute busy share (compute per step x steps/s; AFDFFNSaturated fires above 90%)", [
            (ffn_busy(), "{{afd_io_name}} g{{afd_io_group}} ffn {{rank}} {{shard}}")], "percentunit"),
        panel("Per-layer compute p99 by role", [(quantile(0.99, "afd_layer_compute_seconds", "role, layer"), "{{role}} L{{layer}}")], "s", width=24),
        panel("Expert load per FFN shard (tokens/s routed to its experts, profiled steps)", [
            (f"sum by (rank, shard) (rate(afd_expert_tokens_total{sel(FFN)}[{RATE}]))", "ffn {{rank}} shard {{shard}}")]),
        panel("Expert imbalance per layer (busiest expert / mean expert; 1 = even)", [
            (f"max by (layer) (rate(afd_expert_tokens_total{sel(FFN)}[{RATE}])) / "
             f"avg by (layer) (rate(afd_expert_tokens_total{sel(FFN)}[{RATE}]))", "L{{layer}}")]),
    ])


def connector() -> dict:
    return dashboard("afd-connector", "AFD / Connector and CUDA graphs", [
        panel("Peers up", [(f"afd_peer_up{sel()}", "{{role}} {{rank}} ↔ {{peer}}")]),
        panel("Re-handshakes, refused handshakes and rejected messages", [
            (f"sum by (role, rank) (increase(afd_peer_reconnects_total{sel()}[{RATE}]))", "reconnects {{role}} {{rank}}"),
            (f"sum by (rank) (increase(afd_handshake_failures_total{sel()}[{RATE}]))", "refused hellos ffn {{rank}}"),
            (f"sum by (reason) (increase(afd_rejected_messages_total{sel()}[{RATE}]))", "rejected: {{reason}}")]),
        panel("Transfer bandwidth", [(f"sum by (role, direction) (rate(afd_transfer_bytes_total{sel()}[{RATE}]))", "{{role}} {{direction}}")], "Bps"),
        panel("FFN steps/s", [(f"sum by (rank) (rate(afd_ffn_steps_total{sel()}[{RATE}]))", "ffn {{rank}}")]),
        panel("CUDA graph replays and eager steps", [
            (f"sum by (role) (rate(afd_graph_replays_total{sel()}[{RATE}]))", "replays {{role}}"),
            (f"sum by (role, reason) (rate(afd_graph_eager_steps_total{sel()}[{RATE}]))", "eager {{role}} {{reason}}")]),
        panel("Graph memory and capture time", [(f"sum by (role, rank) (afd_graph_memory_bytes{sel()})", "{{role}} {{rank}} bytes"),
                                                (f"max by (role, rank) (afd_graph_capture_seconds{sel()})", "{{role}} {{rank}} capture s")]),
    ])


def operator() -> dict:
    variables = [VARIABLES[0], variable("namespace", "namespace", "afd_operator_reconcile_total")]
    where = '{namespace=~"$namespace"}'
    return dashboard("afd-operator", "AFD / Operator", [
        panel("Reconciles/s", [(f"sum by (result) (rate(afd_operator_reconcile_total{where}[{RATE}]))", "{{result}}")]),
        panel("Reconcile errors/s", [(f"sum(rate(afd_operator_reconcile_errors_total{where}[{RATE}]))", "errors")]),
        panel("Reconcile duration p99", [
            (f"histogram_quantile(0.99, sum by (le) (rate(afd_operator_reconcile_duration_seconds_bucket{where}[{RATE}])))", "p99")], "s"),
        panel("Groups ready / desired", [(f"sum by (deployment, state) (afd_operator_groups{where})", "{{deployment}} {{state}}")]),
        panel("spec.ratio: attention-busy vs FFN-busy share of a step, per group", [
            (f"max by (deployment, group, side) (afd_operator_ratio_busy_ratio{where})", "{{deployment}} g{{group}} {{side}}")],
              "percentunit"),
        panel("spec.ratio: attention ranks per FFN rank, current vs recommended", [
            (f"max by (deployment, topology) (afd_operator_ratio_attention_per_ffn{where})", "{{deployment}} {{topology}}")]),
        panel("spec.ratio: predicted tokens/s per GPU gain of the recommendation", [
            (f"max by (deployment) (afd_operator_ratio_predicted_gain_ratio{where})", "{{deployment}}")], "percentunit", width=24),
        panel("spec.autoscaling: groups desired vs serving, and decisions", [
            (f"max by (deployment, state) (afd_operator_autoscale_groups{where})", "{{deployment}} {{state}}"),
            (f"sum by (deployment, direction) (increase(afd_operator_autoscale_decisions_total{where}[{RATE}]))",
             "{{deployment}} scaled {{direction}}")]),
        panel("spec.autoscaling: each signal against its target", [
            (f"max by (deployment, signal) (afd_operator_autoscale_signal{where})", "{{deployment}} {{signal}}"),
            (f"max by (deployment, signal) (afd_operator_autoscale_target{where})", "{{deployment}} {{signal}} target")]),
    ], variables)


DASHBOARDS = {"afd-overview": overview, "afd-layers": layers, "afd-connector": connector, "afd-operator": operator}


def render() -> dict[str, str]:
    return {f"{name}.json": json.dumps(make(), indent=2, ensure_ascii=False) + "\n" for name, make in DASHBOARDS.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed dashboard differs from the code")
    args = parser.parse_args()
    stale = []
    for name, text in render().items():
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale dashboards (run scripts/make_dashboards.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
