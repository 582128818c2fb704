"""Does `afd plan`'s model predict a GPU group (issue 19)? A live 1A1F under steady streaming load at
several concurrencies; per level the measured tokens/s, the prediction and the predicted 2A1F/3A1F/2A2F.

    NCCL_NVLS_ENABLE=0 AFD_CONNECTOR=nccl python3 bench/cluster/plan_gpu.py [--layers 27] [--levels 32,128] [--seconds 40]
    python bench/cluster/plan_gpu.py --device cpu --model ~/.cache/afd/tiny-qwen3_moe --levels 2,8 --seconds 10 --ramp 3 \
        --output-tokens 32 --prompt-tokens 8,24          # CPU: the same code path in a minute

Starts serve_gpu.py's `afd` processes (attention rank on GPU 0, FFN on GPU 1, NCCL, CUDA graphs, stages 2, a
random DeepSeek-V2-Lite-shaped bf16 checkpoint unless `--model`). The levels run back to back on the same
streams (added ones start spread over half the ramp; surplus ones stop after their current request): after
`--ramp` s, one scrape of every rank's /metrics, `--seconds` of steady load, another scrape. As
bench/cluster/plan_check.py and `afd plan` do, one model is fitted over every window (steady and transitions: the
costs' growth with the batch needs several loads) and each steady window is compared with the model at that
window's measured batch. The other topologies are predicted at the same load per GPU (`streams` = the
concurrency to run them at). Writes $OUT/plan_gpu.json (with the raw scrapes) and the tail of each rank's
log, $OUT/plan_gpu-<rank>.log.
Exit status: 0 every level within 15 %; 1 a level outside; 2 a rank did not start or stop cleanly, a request
failed, or the metrics were too few to fit (the message says which).

    python bench/cluster/plan_gpu.py --from-json plan_gpu.json [--ffn-rows-from-attention]   # redo the fit offline

`--from-json` refits a saved run's scrapes and prints the same table (no GPU). `--ffn-rows-from-attention`
repairs runs recorded before the FFN counted the rows of graph-replayed steps: its rows become the attention
rank's tokens once per crossing layer (exact for 1A1F).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import require_cuda, write_json  # noqa: E402
from bench.harness.random_weights import write_v2_lite  # noqa: E402
from bench.harness.steady_streams import SteadyStreams  # noqa: E402
from bench.serving.serve_gpu import add_group_arguments, ceilings, keep_log_tails, serving, shell_connector  # noqa: E402

from afd.planner.advice import Bounds, TooFewMetrics  # noqa: E402
from afd.planner.collect import ScrapeError, scrape_once  # noqa: E402
from afd.planner.levels import check_levels  # noqa: E402
from afd.planner.samples import RankSample  # noqa: E402


def progress(text: str) -> None:
    print(f"[plan_gpu {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


async def drive(api: str, model: str, urls: list[str], args, vocab: int) -> tuple[list, list[dict], list[str]]:
    """Every level in turn: ramp, scrape, steady load, scrape. Returns (scrapes, per-level client figures, failures)."""
    scrapes, levels = [], []
    limits = httpx.Limits(max_connections=max(args.levels) + 8, max_keepalive_connections=max(args.levels) + 8)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        streams = SteadyStreams(client, api, model, args.prompt_tokens, args.output_tokens, vocab)
        for count in args.levels:
            streams.resize(count, args.ramp / 2)
            progress(f"{count} streams: ramp {args.ramp:.0f} s")
            if not await streams.hold(args.ramp):
                break
            received, started = streams.received, time.monotonic()
            scrapes.append(await asyncio.to_thread(scrape_once, urls))
            progress(f"{count} streams: steady {args.seconds:.0f} s")
            if not await streams.hold(args.seconds):
                break
            scrapes.append(await asyncio.to_thread(scrape_once, urls))
            seconds = time.monotonic() - started
            levels.append({"streams": count, "client_tokens_per_s": round((streams.received - received) / seconds, 2),
                           "window_seconds": round(seconds, 2)})
            progress(f"{count} streams: {levels[-1]['client_tokens_per_s']:.0f} tokens/s received by the clients")
        progress("stopping the streams after their current request")
        await streams.close()
    return scrapes, levels, streams.failures


def report_levels(report: dict, scrapes: list, step: dict[int, float], args) -> None:
    """Fit over all windows and check each level's steady one (window 2k of level k); fills report['plan']."""
    checked = check_levels(scrapes, [2 * k for k in range(len(report["levels"]))], args.predict,
                           Bounds(max_gpus=args.max_gpus), held_out=True)
    for level, result in zip(report["levels"], checked.pop("levels")):
        for name, prediction in result["predictions"].items():
            prediction["streams"] = round(level["streams"] * prediction["concurrency"] / result["concurrency"], 1)
        level.update(result, ceiling_tokens_per_s=round(level["streams"] / step[level["streams"]], 2)
                     if step.get(level["streams"]) else None)
    report["plan"] = checked


def _held_out(held: dict | None) -> str:
    """The level predicted by a fit without its window: tokens/s, error, and '(flat)' when that fit
    saw a single load (it cannot extrapolate)."""
    if not held or held["predicted_tokens_per_s"] is None:
        return "-"
    flat = "" if held["extrapolates"] else " (flat)"
    return f"{held['predicted_tokens_per_s']:.0f} {held['prediction_error']:.1%}{flat}"


def table(report: dict, args) -> str:
    plan = report["plan"]
    lines = [f"{plan['current']} (stages {plan['stages']}), {plan['windows']} windows, median step-time error of the fit "
             f"{plan['fit_step_error_median']:.1%}",
             f"{'streams':>7} {'measured':>9} {'clients':>9} {'predicted':>9} {'error':>6} {'<15%':>5}  "
             + "  ".join(f"{name + ' tok/s (streams)':>22}" for name in args.predict) + "  recommended  held-out"]
    for level in report["levels"]:
        others = "  ".join(f"{p['tokens_per_s']:>13.0f} ({p['streams']:>6.0f})" for p in level["predictions"].values())
        lines.append(f"{level['streams']:>7} {level['measured_tokens_per_s']:>9.0f} {level['client_tokens_per_s']:>9.0f} "
                     f"{level['predicted_tokens_per_s']:>9.0f} {level['prediction_error']:>6.1%} "
                     f"{'yes' if level['within_tolerance'] else 'NO':>5}  {others}  {level['recommended'] or '-':>11}  "
                     f"{_held_out(level.get('held_out'))}")
    lines += [f"why ({level['streams']} streams): {level['why']}" for level in report["levels"]]
    return "\n".join(lines)


def ffn_rows_from_attention(scrape: list[RankSample]) -> list[RankSample]:
    """1A1F: the FFN serves every token the attention rank computes, once per crossing layer."""
    attention = next(s for s in scrape if s.role == "attention")
    out = []
    for sample in scrape:
        if sample.role == "ffn":
            layers = {key.split("|")[1] for key in sample.values if key.startswith("afd_layer_compute_seconds_sum|")}
            tokens = attention.values.get("afd_step_tokens_sum", 0.0) * len(layers)
            sample = RankSample(sample.role, sample.rank, sample.at, sample.values | {"afd_step_tokens_sum": tokens},
                                sample.info)
        out.append(sample)
    return out


def refit(path: str, args) -> int:
    """Redo the fit and the table of a saved plan_gpu.json (its args, levels and raw scrapes)."""
    report = json.loads(Path(path).read_text())
    scrapes = [[RankSample(**sample) for sample in scrape] for scrape in report["scrapes"]]
    if args.ffn_rows_from_attention:
        scrapes = [ffn_rows_from_attention(scrape) for scrape in scrapes]
    args.predict, args.max_gpus = report["args"]["predict"], report["args"]["max_gpus"]
    levels = [{k: level[k] for k in ("streams", "client_tokens_per_s", "window_seconds")} for level in report["levels"]]
    report["levels"] = levels
    report_levels(report, scrapes, {}, args)
    print(json.dumps({k: v for k, v in report.items() if k != "scrapes"}) if args.json else table(report, args))
    return 0 if all(level["within_tolerance"] for level in report["levels"]) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_group_arguments(parser)
    parser.add_argument("--levels", default="32,128", type=lambda s: [int(x) for x in s.split(",")],
                        help="concurrent streams per level (at least two different)")
    parser.add_argument("--seconds", type=float, default=40.0, help="steady window of each level")
    parser.add_argument("--ramp", type=float, default=10.0, help="seconds before each level's first scrape")
    parser.add_argument("--prompt-tokens", default="32,128", type=lambda s: tuple(int(x) for x in s.split(",")))
    parser.add_argument("--output-tokens", type=int, default=512,
                        help="the longest completion (shortest: half); long ones keep most steps prefill-free")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--predict", default="2A1F,3A1F,2A2F", type=lambda s: s.split(","))
    parser.add_argument("--max-gpus", type=int, default=4, help="largest group the recommendation may choose")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--request-timeout", type=float, default=120)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--from-json", help="refit a saved plan_gpu.json offline and print its table")
    parser.add_argument("--ffn-rows-from-attention", action="store_true",
                        help="with --from-json: the FFN's rows from the attention rank's tokens (runs before the fix)")
    args = parser.parse_args()
    require_cuda(__file__)
    if args.from_json:
        return refit(args.from_json, args)
    if len(set(args.levels)) < 2:
        parser.error(f"--levels {args.levels}: need at least two different concurrencies to fit the costs' growth")
    model = args.model
    if not model:
        started = time.monotonic()
        model = str(write_v2_lite(Path(args.checkpoint_dir) / f"v2lite-{args.layers}", args.layers, args.device))
        progress(f"checkpoint {model} ({args.layers} layers) written in {time.monotonic() - started:.0f} s")
    report = {"model": model, "args": vars(args), "levels": []}
    started = time.monotonic()
    progress(f"starting {args.topology} on {args.device} ({shell_connector('default connector')})")
    try:
        keep = lambda processes: keep_log_tails(processes, "plan_gpu")  # noqa: E731
        with serving("afd", args, model, on_failure=keep) as (processes, envs, api):
            report["start_seconds"] = round(time.monotonic() - started, 1)
            progress(f"healthy in {report['start_seconds']:.0f} s")
            urls = [f"http://127.0.0.1:{env['AFD_METRICS_PORT']}/metrics" for env in envs.values()]
            step = ceilings(api)
            served = httpx.get(f"{api}/v1/models").json()["data"][0]["id"]
            vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
            scrapes, report["levels"], failures = asyncio.run(drive(f"{api}/v1", served, urls, args, vocab))
            progress("stopping the ranks")
    except SystemExit as err:  # a rank did not start (serve_gpu.wait_ready says which); its log tail is in $OUT
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ScrapeError as err:
        scrapes, failures = [], [f"scrape: {err}"]
    report["exit_codes"] = {name: child.returncode for name, child in processes.children.items()}
    keep_log_tails(processes, "plan_gpu")
    report["scrapes"] = [[vars(sample) for sample in scrape] for scrape in scrapes]
    problems = [f"{len(failures)} requests failed, first: {failures[:3]}"] if failures else []
    if any(report["exit_codes"].values()):
        problems.append(f"unclean stops: {report['exit_codes']} (logs: {processes.workdir})")
    if not problems:
        try:
            report_levels(report, scrapes, step, args)
        except TooFewMetrics as err:
            problems.append(f"too few metrics: {err}")
    report["problems"] = problems
    write_json("plan_gpu", report)
    if not problems:
        print(json.dumps({k: v for k, v in report.items() if k != "scrapes"}) if args.json
              else table(report, args), flush=True)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 2
    return 0 if all(level["within_tolerance"] for level in report["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
