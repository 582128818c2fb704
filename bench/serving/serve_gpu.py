"""What a user gets on GPUs: the real `afd serve` processes driven through the OpenAI API, against their own step ceiling.

    AFD_CONNECTOR=nccl python bench/serving/serve_gpu.py [--layers 27] [--levels 1,16,64,256,512] [--modes afd,monolithic]
    python bench/serving/serve_gpu.py --device cpu --layers 2 --levels 1,4 --output-tokens 8 --prompt-tokens 16,32   # CPU smoke

Writes (or takes `--model`) a DeepSeek-V2-Lite-shaped random bf16 checkpoint (bench/harness/random_weights.py),
then per mode starts the processes a pod runs: `afd` = the `--topology` group (attention rank a on GPU a,
FFN rank f on GPU A+f, `AFD_CONNECTOR` nccl by default on GPUs, CUDA graphs, `--stages`), `monolithic` =
one `AFD_ROLE=monolithic` process on GPU 0. Each rank times its graph-replayed decode step at every level's
batch at start (`AFD_CEILING_BATCHES`, `afd_step_ceiling_seconds`). Then, per level, that many concurrent
streams each send `--requests-per-stream` streamed completions (prompts of random token ids, lengths
uniform in `--prompt-tokens`, `--output-tokens` tokens, ignore_eos, greedy).

Per level: output tokens/s over the level's wall time (prefills included), TTFT and ITL p50/p99, the
decode tokens/s (streams ÷ mean ITL), the ceiling (batch ÷ step time at that batch) and serving efficiency
= decode tokens/s ÷ ceiling (= ceiling step time ÷ mean ITL), and the pace = ceiling step time ÷ ITL p50
(the host's cost per step alone: steps shared with prefill chunks are in the mean, not the median). Failed requests are counted; every rank
must exit 0 on SIGTERM afterwards. Prints a table and writes $OUT/serve_gpu.json (or ./serve_gpu.json).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.clients import one_request  # noqa: E402
from bench.harness.measure import write_json  # noqa: E402
from bench.harness.measure import percentile  # noqa: E402
from bench.harness.random_weights import write_v2_lite  # noqa: E402

from afd.config import values_from_env  # noqa: E402
from afd.local.children import LocalProcesses, free_port_block, threads_per_rank  # noqa: E402
from afd.config.topology import Topology  # noqa: E402


def shell_connector(default: str) -> str:
    """`AFD_CONNECTOR` of this shell, read through `afd.config`'s environment table as a rank reads it, else
    `default` (a bad name is the ranks' `ConfigError`)."""
    return values_from_env(os.environ, hostname_rank=False).get("connector", default)


def rank_envs(mode: str, args, model: str) -> dict[str, dict[str, str]]:
    """name → AFD_* environment of every process of `mode` (the API-serving rank is named 'api')."""
    gpu = args.device == "cuda"
    ports = free_port_block(128)  # API +0/+1; FFN control/data +2+2f/+3+2f; FFN metrics +64+f; attention a>0 +96+2a
    levels = sorted({*args.levels, *getattr(args, "penalty_levels", ()), *getattr(args, "arriving_levels", ())})
    common = {"AFD_MODEL": model, "AFD_DEVICE": args.device, "AFD_CUDA_GRAPHS": str(gpu).lower(),
              "AFD_MAX_NUM_SEQS": str(max(levels)), "AFD_MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens),
              "AFD_CEILING_BATCHES": ",".join(map(str, levels)),
              "AFD_CEILING_CONTEXT": str(sum(args.prompt_tokens) // 2 + args.output_tokens // 2),
              "AFD_HTTP_HOST": "127.0.0.1", "AFD_HTTP_PORT": str(ports), "AFD_METRICS_PORT": str(ports + 1),
              "AFD_MAX_MODEL_LEN": str(max(args.prompt_tokens) + args.output_tokens + 16)}
    if args.prefill_itl_ratio is not None:
        common["AFD_PREFILL_ITL_RATIO"] = str(args.prefill_itl_ratio)
    if mode == "monolithic":
        return {"api": {**common, "AFD_ROLE": "monolithic", **({"CUDA_VISIBLE_DEVICES": "0"} if gpu else {})}}
    topology = Topology.parse(args.topology)
    group = {**common, "AFD_TOPOLOGY": args.topology, "AFD_STAGES": str(args.stages), "AFD_FFN_ADDRESS_TEMPLATE": "127.0.0.1",
             "AFD_CONNECTOR": shell_connector("nccl" if gpu else "zmq"), "AFD_BIND_HOST": "127.0.0.1",
             "AFD_CONTROL_PORT": str(ports + 2), "AFD_DATA_PORT": str(ports + 3), "AFD_PORT_STRIDE": "2"}
    envs = {}
    for f in range(topology.num_ffn):
        envs[f"ffn-{f}"] = {**group, "AFD_ROLE": "ffn", "AFD_RANK": str(f), "AFD_METRICS_PORT": str(ports + 64 + f),
                            **({"CUDA_VISIBLE_DEVICES": str(topology.num_attention + f)} if gpu else {})}
    for a in range(topology.num_attention):  # only rank 0 is driven; the others serve nothing here
        envs["api" if a == 0 else f"attention-{a}"] = {
            **group, "AFD_ROLE": "attention", "AFD_RANK": str(a), "AFD_HTTP_PORT": str(ports + (96 + 2 * a if a else 0)),
            "AFD_METRICS_PORT": str(ports + (97 + 2 * a if a else 1)), **({"CUDA_VISIBLE_DEVICES": str(a)} if gpu else {})}
    return envs


def wait_ready(processes: LocalProcesses, api: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, child in processes.children.items():
            if child.poll() is not None:
                raise SystemExit(f"{name} exited during start-up: {processes.last_error(name)} (logs: {processes.workdir})")
        try:
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"not healthy after {timeout_s:.0f} s (logs: {processes.workdir})")


def ceilings(api: str) -> dict[int, float]:
    """batch → graph-replayed step seconds, as the rank measured them at start."""
    text = httpx.get(f"{api}/metrics", timeout=10).text
    return {int(b): float(v) for b, v in re.findall(r'afd_step_ceiling_seconds\{[^}]*batch="(\d+)"[^}]*\} (\S+)', text)}


def kernel_compiles(api: str) -> float:
    """afd_kernel_compiles_total of the rank behind `api`: Triton specializations compiled while serving."""
    text = httpx.get(f"{api}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r'^afd_kernel_compiles_total\{[^}]*\} (\S+)', text, re.M))


async def drive_level(api: str, model: str, streams: int, args, rng: random.Random, vocab: int) -> dict:
    """`streams` concurrent streams from this process, each sending its requests back to back."""
    prompts = make_prompts(streams * args.requests_per_stream, args, rng, vocab)
    return level_summary(streams, len(prompts), [await drive_streams(api, model, streams, prompts, args.output_tokens,
                                                                     getattr(args, "request_extra", None))])


def drive_level_spread(api: str, model: str, streams: int, args, rng: random.Random, vocab: int) -> dict:
    """As `drive_level`, the streams spread over `args.client_processes` processes (0: one per 64 streams), so the
    client's own per-token work (one Python event loop parsing every event) never paces what is measured."""
    processes = min(args.client_processes or -(-streams // 64), streams)
    if processes <= 1:
        return asyncio.run(drive_level(api, model, streams, args, rng, vocab))
    prompts = make_prompts(streams * args.requests_per_stream, args, rng, vocab)
    shares = [streams // processes + (i < streams % processes) for i in range(processes)]
    cuts = [sum(shares[:i]) * args.requests_per_stream for i in range(processes + 1)]
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork")) as pool:
        parts = list(pool.map(_drive_share, [(api, model, share, prompts[cuts[i]: cuts[i + 1]], args.output_tokens,
                                              getattr(args, "request_extra", None)) for i, share in enumerate(shares)]))
    return level_summary(streams, len(prompts), parts)


def _drive_share(work: tuple) -> dict:
    return asyncio.run(drive_streams(*work))


def make_prompts(count: int, args, rng: random.Random, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(*args.prompt_tokens))] for _ in range(count)]


async def drive_streams(api: str, model: str, streams: int, prompts: list, output_tokens: int,
                        extra: dict | None = None) -> dict:
    """Raw results of `streams` streams taking `prompts` until none is left (`extra`: more fields in every
    request); wall-clock start and end."""
    ttfts, itls, failures, tokens, prompts = [], [], [], [0], list(prompts)
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        async def stream_loop():
            while prompts:
                prompt = prompts.pop()
                try:
                    got = await one_request(client, api, model, prompt, output_tokens, ttfts, itls, extra)
                    tokens[0] += got
                    if got != output_tokens:
                        failures.append(f"{got} of {output_tokens} tokens")
                except Exception as err:  # noqa: BLE001 — every failure is counted and reported
                    failures.append(f"{type(err).__name__}: {err}")

        started = time.time()
        await asyncio.gather(*(stream_loop() for _ in range(streams)))
        ended = time.time()
    return {"ttfts": ttfts, "itls": itls, "failures": failures, "tokens": tokens[0], "started": started, "ended": ended}


def level_summary(streams: int, requests: int, parts: list[dict]) -> dict:
    ttfts = [t for part in parts for t in part["ttfts"]]
    itls = [t for part in parts for t in part["itls"]]
    failures = [f for part in parts for f in part["failures"]]
    seconds = max(part["ended"] for part in parts) - min(part["started"] for part in parts)
    mean_itl = statistics.fmean(itls) if itls else float("nan")
    return {"streams": streams, "requests": requests, "client_processes": len(parts), "failed": len(failures),
            "first_failures": failures[:3], "seconds": seconds,
            "tokens_per_s": sum(part["tokens"] for part in parts) / seconds,
            "ttft_p50_ms": 1e3 * statistics.median(ttfts) if ttfts else None, "ttft_p99_ms": 1e3 * percentile(ttfts, 0.99),
            "itl_p50_ms": 1e3 * statistics.median(itls) if itls else None, "itl_p99_ms": 1e3 * percentile(itls, 0.99),
            "itl_p95_ms": 1e3 * percentile(itls, 0.95), "itl_share_over_2x_p50": _share_over(itls, 2),
            "decode_tokens_per_s": streams / mean_itl}


def _share_over(itls: list[float], times: float) -> float | None:
    """The fraction of inter-token gaps longer than `times` × their median (the ITL goal allows 1% over 2×)."""
    if not itls:
        return None
    limit = times * statistics.median(itls)
    return sum(gap > limit for gap in itls) / len(itls)


@contextlib.contextmanager
def serving(mode: str, args, model: str, on_failure=None):
    """The processes of `mode`, started and healthy: yields (processes, envs, API URL); on a clean
    exit stops attention first (it says Goodbye), then the FFN ranks. `on_failure(processes)` runs
    when starting them or the block fails, before they are killed."""
    envs = rank_envs(mode, args, model)
    api = f"http://127.0.0.1:{envs['api']['AFD_HTTP_PORT']}"
    threads = threads_per_rank(len(envs)) if args.device == "cpu" else {}
    with LocalProcesses(grace_s=60) as processes:
        try:
            for name in sorted(envs, key=lambda n: not n.startswith("ffn")):  # FFN ranks listen first
                processes.start(name, ["serve"], {**envs[name], **threads})
            wait_ready(processes, api, args.start_timeout)
            yield processes, envs, api
        except BaseException:
            if on_failure is not None:
                on_failure(processes)
            raise
        names = list(processes.children)
        processes.stop(*[n for n in names if not n.startswith("ffn")])
        processes.stop(*[n for n in names if n.startswith("ffn")])


def largest_batch(mode: str, args, model: str) -> int:
    """The most sequences of `args.context` + output tokens that `mode`'s KV cache holds (at most
    `args.largest_cap`): a probe start reads `afd_kv_cache_capacity_tokens` and the block size."""
    probe = argparse.Namespace(**{**vars(args), "levels": [1]})
    with serving(mode, probe, model) as (_, _, api):
        text = httpx.get(f"{api}/metrics", timeout=10).text
    capacity = float(re.search(r"^afd_kv_cache_capacity_tokens(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))
    block = 16  # afd.kv.cache.DEFAULT_BLOCK_SIZE
    per_sequence = -(-(args.context + args.output_tokens) // block) * block
    fits = int(capacity) // per_sequence
    print(f"{mode}: KV cache of {int(capacity):,} tokens holds {fits:,} sequences of {args.context} + "
          f"{args.output_tokens} tokens; running {min(fits, args.largest_cap):,}", flush=True)
    return min(fits, args.largest_cap)


def run_mode(mode: str, args, model: str) -> dict:
    if args.largest_batch:
        args = argparse.Namespace(**{**vars(args), "levels": [largest_batch(mode, args, model)]})
    envs = rank_envs(mode, args, model)
    api = f"http://127.0.0.1:{envs['api']['AFD_HTTP_PORT']}"
    threads = threads_per_rank(len(envs)) if args.device == "cpu" else {}
    results = {"mode": mode, "levels": []}
    with LocalProcesses(grace_s=60) as processes:
        started = time.monotonic()
        for name in sorted(envs, key=lambda n: not n.startswith("ffn")):  # FFN ranks listen first
            processes.start(name, ["serve"], {**envs[name], **threads})
        wait_ready(processes, api, args.start_timeout)
        results["start_seconds"] = time.monotonic() - started
        step = ceilings(api)
        served = httpx.get(f"{api}/v1/models").json()["data"][0]["id"]
        rng, vocab = random.Random(0), json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        warm = argparse.Namespace(**{**vars(args), "requests_per_stream": 1, "output_tokens": 4})
        results["kernel_compiles_at_start"] = kernel_compiles(api)  # after warm-up, before any request
        asyncio.run(drive_level(f"{api}/v1", served, 1, warm, rng, vocab))
        compiles = kernel_compiles(api)
        results["kernel_compiles_first_request"] = compiles - results["kernel_compiles_at_start"]
        print(f"Triton specializations compiled while serving: {results['kernel_compiles_at_start']:.0f} before the "
              f"first request, {results['kernel_compiles_first_request']:.0f} in it", flush=True)
        for streams, kind, level_args in level_plan(args):
            level = drive_level_spread(f"{api}/v1", served, streams, level_args, rng, vocab)
            level["kind"] = kind
            compiles, before = kernel_compiles(api), compiles
            level["kernel_compiles"] = compiles - before  # each a pause: the rank's log names the kernels
            seconds = step.get(streams)
            level["ceiling_step_ms"] = 1e3 * seconds if seconds else None
            level["ceiling_tokens_per_s"] = streams / seconds if seconds else None
            level["efficiency"] = level["decode_tokens_per_s"] / level["ceiling_tokens_per_s"] if seconds else None
            # the step's pace alone: the median gap against the step (prefill-shared steps are the tail, not the median)
            level["pace"] = 1e3 * seconds / level["itl_p50_ms"] if seconds and level["itl_p50_ms"] else None
            plain = next((done for done in results["levels"] if done["streams"] == streams and done["kind"] == "burst"
                          and done["requests"] == level["requests"]), None)
            if kind == "penalties" and plain is not None:  # issue 34: penalties cost at most 10 % of throughput
                level["tokens_per_s_vs_plain"] = level["tokens_per_s"] / plain["tokens_per_s"]
                level["decode_tokens_per_s_vs_plain"] = level["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
            results["levels"].append(level)
            print_level(f"{mode[:4]}:{kind[:5]}" if kind != "burst" else mode, level, flush=True)
            if "tokens_per_s_vs_plain" in level:
                print(f"  penalties vs none at {streams} streams: tok/s x{level['tokens_per_s_vs_plain']:.3f}, "
                      f"decode tok/s x{level['decode_tokens_per_s_vs_plain']:.3f}", flush=True)
            if level["failed"]:
                print(f"  first failures: {level['first_failures']}", flush=True)
            if level["kernel_compiles"]:
                print(f"  {level['kernel_compiles']:.0f} Triton kernel specializations compiled during this level "
                      f"(WARNING lines in the rank's log name them)", flush=True)
        names = list(processes.children)
        processes.stop(*[n for n in names if not n.startswith("ffn")])  # attention first: it says Goodbye
        processes.stop(*[n for n in names if n.startswith("ffn")])
        results["exit_codes"] = {name: child.returncode for name, child in processes.children.items()}
        results["logs"] = str(processes.workdir)
        if any(level["failed"] for level in results["levels"]) or any(results["exit_codes"].values()):
            keep_log_tails(processes, mode)
    return results


PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}


def level_plan(args) -> list[tuple[int, str, argparse.Namespace]]:
    """(streams, kind, arguments) of every level a server runs, in order: the bursts of `--levels`; then
    `--penalty-levels`, the same burst with presence, frequency and repetition penalties in every request;
    then `--arriving-levels`, `--arriving-requests` requests per stream of `--arriving-output-tokens` tokens
    (each stream's next prompt arrives when its last request ends)."""
    plan = [(streams, "burst", args) for streams in args.levels]
    penalties = argparse.Namespace(**{**vars(args), "request_extra": PENALTIES})
    plan += [(streams, "penalties", penalties) for streams in args.penalty_levels]
    arriving = argparse.Namespace(**{**vars(args), "requests_per_stream": args.arriving_requests,
                                     "output_tokens": args.arriving_output_tokens})
    return plan + [(streams, "arriving", arriving) for streams in args.arriving_levels]


def keep_log_tails(processes: LocalProcesses, mode: str, lines: int = 400) -> None:
    """The last lines of every rank's log next to the report ($OUT or .), so a failed run can be read later."""
    out = Path(os.environ.get("OUT", "."))
    for name in processes.children:
        text = processes.log_path(name).read_text(errors="replace").splitlines()[-lines:]
        (out / f"{mode}-{name}.log").write_text("\n".join(text) + "\n")


def print_level(mode: str, level: dict, flush: bool = False) -> None:
    def fmt(value, spec):
        return format(value, spec) if value is not None else "-"

    print(f"{mode:>10} {level['streams']:>6} {level['tokens_per_s']:>9.0f} {fmt(level['ttft_p50_ms'], '>8.0f')} "
          f"{level['ttft_p99_ms']:>8.0f} {fmt(level['itl_p50_ms'], '>7.1f')} {level['itl_p99_ms']:>7.1f} "
          f"{level['decode_tokens_per_s']:>9.0f} {fmt(level['ceiling_tokens_per_s'], '>9.0f')} "
          f"{fmt(level['efficiency'], '>5.2f')} {fmt(level.get('pace'), '>5.2f')} {level['failed']:>6}", flush=flush)


def add_group_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint, the group's shape and its prefill pacing, as every GPU serving benchmark takes them."""
    parser.add_argument("--model", help="checkpoint folder (default: write a random DeepSeek-V2-Lite-shaped one)")
    parser.add_argument("--checkpoint-dir", default="/tmp/afd-serve-gpu", help="where the random checkpoint is written")
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--topology", default="1A1F")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--prefill-itl-ratio", type=float,
                        help="AFD_PREFILL_ITL_RATIO of every rank (default: the runtime's; 0: prompts are not paced)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_group_arguments(parser)
    parser.add_argument("--modes", default="afd,monolithic")
    parser.add_argument("--levels", default="1,16,64,256,512", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt-tokens", default="128,1024", type=lambda s: tuple(int(x) for x in s.split(",")))
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--requests-per-stream", type=int, default=1,
                        help="more than 1: new prompts keep arriving while the others decode (chunked prefill)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the step's token budget (chunked prefill)")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--client-processes", type=int, default=0,
                        help="processes the benchmark's client streams are spread over (0: one per 64 streams)")
    parser.add_argument("--context", type=int, help="every prompt this many tokens (instead of --prompt-tokens)")
    parser.add_argument("--largest-batch", action="store_true",
                        help="per mode, one level: as many streams as its KV cache holds at --context (a probe start "
                             "reads the capacity), at most --largest-cap")
    parser.add_argument("--largest-cap", type=int, default=4096)
    numbers = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--penalty-levels", default="", type=numbers,
                        help=f"after --levels, these bursts again with {PENALTIES} in every request (issue 34: "
                             "the throughput with penalties against the same level without)")
    parser.add_argument("--arriving-levels", default="", type=numbers,
                        help="after those, these levels with prompts arriving while the others decode")
    parser.add_argument("--arriving-requests", type=int, default=4, help="requests per stream of an arriving level")
    parser.add_argument("--arriving-output-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.context:
        args.prompt_tokens = (args.context, args.context)
    elif args.largest_batch:
        parser.error("--largest-batch needs --context")
    model = args.model
    if not model:
        started = time.monotonic()
        model = str(write_v2_lite(Path(args.checkpoint_dir) / f"v2lite-{args.layers}", args.layers, args.device))
        print(f"checkpoint: {model} ({args.layers} layers) written in {time.monotonic() - started:.0f} s", flush=True)
    print(f"{'mode':>10} {'streams':>6} {'tok/s':>9} {'TTFT p50':>8} {'p99':>8} {'ITL p50':>7} {'p99':>7} "
          f"{'decode/s':>9} {'ceiling':>9} {'eff':>5} {'pace':>5} {'failed':>6}", flush=True)
    report = {"model": model, "args": {k: v for k, v in vars(args).items()}, "modes": []}
    for mode in args.modes.split(","):
        report["modes"].append(run_mode(mode, args, model))
    write_json("serve_gpu", report)
    bad = [(m["mode"], m["exit_codes"]) for m in report["modes"] if any(m["exit_codes"].values())]
    failed = sum(level["failed"] for m in report["modes"] for level in m["levels"])
    print(f"failed requests: {failed}; unclean stops: {bad or 'none'}")
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
