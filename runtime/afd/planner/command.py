"""`afd plan`: scrape a running group, fit its cost model, recommend an attention:FFN ratio."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from afd.config import ConfigError


def add_parser(commands) -> None:
    plan = commands.add_parser("plan", help="recommend an attention:FFN ratio from a running group's metrics")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--scrape", nargs="+", metavar="URL", help="every rank's /metrics URL (one group)")
    source.add_argument("--state-file", help="the JSON state file of `afd up --state-file`")
    source.add_argument("--prometheus", metavar="URL", help="a Prometheus that scrapes the group (PodMonitor labels)")
    source.add_argument("--fit", metavar="CR", help="size an AFDDeployment file instead: what each rank holds (weights, "
                                                    "FP8 scales, KV tokens) for --model-config; exit 1 if a rank "
                                                    "cannot hold its share (docs: README, supported models)")
    plan.add_argument("--model-config", metavar="PATH", help="with --fit: the checkpoint folder or its config.json")
    plan.add_argument("--gpu-memory-gib", type=float,
                      help="with --fit: GPU memory per rank (default: from nodeSelector nvidia.com/gpu.product)")
    plan.add_argument("--deployment", help="with --prometheus: the AFDDeployment (label afd_io_name)")
    plan.add_argument("--group", type=int, default=0, help="with --prometheus: the group (label afd_io_group)")
    plan.add_argument("--namespace", help="with --prometheus: the namespace (label namespace)")
    plan.add_argument("--samples", type=int, default=4, help="scrapes to take (windows = samples - 1)")
    plan.add_argument("--interval", type=float, default=10.0,
                      help="seconds between scrapes (with --prometheus: between the past instants queried)")
    plan.add_argument("--min-attention-per-ffn", type=float, default=1.0)
    plan.add_argument("--max-attention-per-ffn", type=float, default=8.0)
    plan.add_argument("--max-gpus", type=int, default=16, help="largest group to consider")
    plan.add_argument("--min-gain", type=float, default=0.10, help="recommend a change only above this gain per GPU")
    plan.add_argument("--json", action="store_true", help="print one JSON object")


def cmd_fit(args: argparse.Namespace) -> int:
    """`afd plan --fit CR --model-config PATH`: the sizing table; 1 when a rank cannot hold its share."""
    import yaml  # local import: only `afd plan --fit` reads a CR

    from afd.models.spec import UnsupportedModelError  # local import: model code: only when sizing
    from afd.planner.fit import FitError, fit, render_fit  # local import: torch and the model code: only when sizing

    if not args.model_config:
        raise ConfigError("--fit needs --model-config PATH (a checkpoint folder or its config.json)")
    config_path = Path(args.model_config)
    config_path = config_path / "config.json" if config_path.is_dir() else config_path
    try:
        config = json.loads(config_path.read_text())
        cr = yaml.safe_load(Path(args.fit).read_text())
        gpu_bytes = int(args.gpu_memory_gib * (1 << 30)) if args.gpu_memory_gib else None
        report = fit(config, cr, gpu_bytes, model_name=str(args.model_config))
    except (OSError, json.JSONDecodeError, yaml.YAMLError, FitError, UnsupportedModelError, KeyError) as err:
        raise ConfigError(f"cannot size: {err}") from None
    print(json.dumps(_fit_json(report)) if args.json else render_fit(report))
    return 1 if report.refused else 0


def _fit_json(report) -> dict:
    return {"model": report.model, "dtype": report.dtype, "fp8": report.fp8, "refused": report.refused,
            "ranks": [asdict(rank) for rank in report.ranks]}


def cmd_plan(args: argparse.Namespace) -> int:
    if args.fit:
        return cmd_fit(args)
    from afd.planner.advice import Bounds, TooFewMetrics, plan  # local import: prometheus_client: only `afd plan` parses metrics
    from afd.planner.collect import ScrapeError, scrape_series, urls_from_state_file  # local import: httpx: only when scraping
    from afd.planner.prometheus import PrometheusError, scrape_history, selector  # local import: prometheus_client (as above)

    if args.samples < 2:
        raise ConfigError(f"--samples {args.samples}: need at least 2 (one window)")
    if args.interval <= 0:
        raise ConfigError(f"--interval {args.interval}: must be positive")
    if args.prometheus and not args.deployment:
        raise ConfigError("--prometheus needs --deployment NAME (the AFDDeployment whose group to plan)")
    try:
        bounds = Bounds(args.min_attention_per_ffn, args.max_attention_per_ffn, args.max_gpus, args.min_gain)
        if args.prometheus:
            labels = selector(args.deployment, args.group, args.namespace)
            scrapes = scrape_history(args.prometheus, labels, args.samples, args.interval, time.time())
        else:
            urls = args.scrape or urls_from_state_file(args.state_file)
            progress = (lambda _: None) if args.json else (lambda text: print(text, file=sys.stderr, flush=True))
            scrapes = scrape_series(urls, args.samples, args.interval, progress)
        result = plan(scrapes, bounds)
    except (ValueError, ScrapeError, PrometheusError) as err:
        kind = "too few metrics" if isinstance(err, TooFewMetrics) else "cannot plan"
        raise ConfigError(f"{kind}: {err}") from None
    print(json.dumps(result) if args.json else render_table(result))
    return 0


def render_table(result: dict) -> str:
    """The human answer of `afd plan`; any field may be null (an idle window has no error, a fit no advice): "-"."""
    recommended_rate = _number(result.get("recommended_tokens_per_s"), ".1f")
    gain = _number(result.get("predicted_gain"), "+.0%")
    lines = [
        f"current      {_text(result.get('current'))} (stages {_text(result.get('stages'))}), "
        f"{_number(result.get('concurrency'), '.0f')} decoding sequences",
        f"measured     {_number(result.get('measured_tokens_per_s'), '.1f')} tokens/s",
        f"predicted    {_number(result.get('predicted_tokens_per_s'), '.1f')} tokens/s "
        f"(model error {_number(result.get('prediction_error'), '.1%')})",
        f"recommended  {_text(result.get('recommended'))}"
        + (f" ({recommended_rate} tokens/s)" if result.get("recommended_tokens_per_s") is not None else "")
        + (f", {gain} per GPU" if result.get("predicted_gain") is not None else ""),
        f"why          {_text(result.get('why'))}",
    ]
    if result.get("prefix_hit_rate") is not None:
        lines.insert(3, f"prefix cache {result['prefix_hit_rate']:.1%} of prompt tokens found cached (not computed: "
                        "the fitted step cost counts only the tokens computed)")
    if result.get("per_gpu"):
        lines.append("tokens/s per GPU at the same load per GPU:")
        ranked = sorted(result["per_gpu"].items(), key=lambda item: -(item[1] if item[1] is not None else float("-inf")))[:8]
        lines += [f"  {topology:>6}  {_number(value, '10.1f'):>10}" for topology, value in ranked]
    return "\n".join(lines)


def _number(value, spec: str) -> str:
    """`value` formatted with `spec`, or "-" where it is null."""
    return "-" if value is None else format(value, spec)


def _text(value) -> str:
    return "-" if value is None or value == "" else str(value)
