"""CPU cost of the serving process's output path, per token, with no model: the real app and engine
around a stand-in step.

    PYTHONPATH=runtime .venv/bin/python bench/serving/output_path.py --streams 16 64 256 --runs 3
    # before/after, interleaved: one server per tree and run, alternating
    .venv/bin/python bench/serving/output_path.py --tree main=/work/main/runtime --tree out=runtime
    # one process against the API in its own process (AFD_API_PROCESS), interleaved
    PYTHONPATH=runtime .venv/bin/python bench/serving/output_path.py --modes one split --step-ms 15

The server (a subprocess) runs the real `Engine` (pipelined, output thread, metrics observer),
`create_app` behind `Failover` and uvicorn, exactly as `afd serve` does; only the step is
replaced by one that sleeps `--step-ms` (the GPU, GIL released) and returns logits whose argmax
spells a fixed English text, so the tiny model's tokenizer detokenizes real words. This process
is the client: N concurrent httpx streams (`/v1/completions`, `ignore_eos`). Per level it prints
tokens/s, ITL mean/p99 (events read together arrived together), the server's CPU µs per token (whole process and per thread), and stage
timers (CPU µs per token inside each stage; a stage a tree does not have reads `-`).

With `--modes split` the server runs as `AFD_API_PROCESS=1` does (`afd.server.api_process`): the
engine in the server process, the app in its child. CPU is then per process (`proc:core`,
`proc:api`), `cpu_us` their sum, and the stage timers cover the core only.

This file is the client and the report; the server is `output_path_server.py`, its CPU accounting (stage
timers, CPU per thread and process) `output_path_cpu.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # `bench` (run as bench/<folder>/<name>.py); `afd` is the tree under test's

from bench.serving.output_path_cpu import STAGES  # noqa: E402
from bench.serving.output_path_server import TEXT, serve  # noqa: E402


async def stream(port: int, max_tokens: int, arrivals: list) -> int:
    """One streaming completion over a plain HTTP/1.1 socket; the times of the reads that held events.

    A minimal client on purpose: httpx costs the client ~10x more CPU per event, and on a small
    machine the client, not the server, would set the pace."""
    body = json.dumps({"model": "stand-in", "prompt": f"Request {len(arrivals)}: {TEXT[:60]}", "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    tokens, times, tail = 0, [], b""
    try:
        while data := await reader.read(65536):
            if not tail and not data.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the server answered {data[:200]!r}")
            window = tail + data
            events = window.count(b'data: {"id"') - tail.count(b'data: {"id"')
            if events:
                times.extend([time.perf_counter()] * events)  # events read together arrived together
                tokens += events
            tail = window[-16:]
    finally:
        writer.close()
    arrivals.append(times)
    return tokens


async def level(port: int, streams: int, max_tokens: int, split: bool = False) -> dict:
    import httpx

    url = f"http://127.0.0.1:{port + 2}" if split else f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(stream(port, 4, []) for _ in range(min(streams, 16))))  # warm-up
        before = (await client.get(f"{url}/bench/stats")).json()
        arrivals: list = []
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(stream(port, max_tokens, arrivals) for _ in range(streams))))
        seconds = time.perf_counter() - started
        after = (await client.get(f"{url}/bench/stats")).json()
    served = after["tokens"] - before["tokens"]
    if tokens != streams * max_tokens:
        raise RuntimeError(f"expected {streams * max_tokens} tokens, the streams got {tokens}")
    itls = sorted(b - a for times in arrivals for a, b in zip(times, times[1:]))
    result = {"tok_s": tokens / seconds, "cpu_us": 1e6 * (after["cpu_s"] - before["cpu_s"]) / served,
              "itl_mean": 1e3 * statistics.mean(itls), "itl_p99": 1e3 * itls[int(0.99 * (len(itls) - 1))]}
    for name, value in after["threads"].items():
        result[f"thread:{name}"] = 1e6 * (value - before["threads"].get(name, 0.0)) / served
    for stage in STAGES:
        present = stage in after["present"]
        result[f"stage:{stage}"] = 1e6 * (after["stages"][stage] - before["stages"][stage]) / served if present else None
    return result


def start_server(tree: str, port: int, step_ms: float, tokenizer: str, profile: str | None,
                 split: bool = False) -> subprocess.Popen:
    """`tree` is a runtime/ directory, optionally followed by more import paths (`path:path`)."""
    tree, *extra = [os.path.abspath(path) for path in tree.split(os.pathsep)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, str(Path(tree).parent / "operator"), *extra])}
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--step-ms", str(step_ms),
                               "--tokenizer", tokenizer] + (["--profile", profile] if profile else [])
                              + (["--split"] if split else []), env=env)
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).raise_for_status()
            return server
        except httpx.HTTPError:
            if server.poll() is not None:
                raise SystemExit(f"the server for {tree} exited with {server.returncode}")
            time.sleep(0.3)
    server.kill()
    raise SystemExit(f"the server for {tree} did not start in 120 s")


def report(results: dict) -> None:
    """Medians over runs, one block per level, one column per tree."""
    trees = list(results)
    levels = list(next(iter(results.values())))
    for streams in levels:
        print(f"\n{streams} streams (median of {len(results[trees[0]][streams])} runs)")
        print(f"  {'':24}" + "".join(f"{t:>12}" for t in trees))
        keys = sorted({k for t in trees for run in results[t][streams] for k in run},
                      key=lambda k: (k.startswith("stage:"), k.startswith("thread:"), k))
        for key in keys:
            cells = []
            for tree in trees:
                values = [run[key] for run in results[tree][streams] if run.get(key) is not None]
                cells.append(f"{statistics.median(values):12.1f}" if values else f"{'-':>12}")
            print(f"  {key:24}" + "".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append",
                        help="name=path of a runtime/ directory, then optionally :more:import:paths (default: this one)")
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=5.0, help="the stand-in step's duration (the GPU's)")
    parser.add_argument("--port", type=int, default=8191)
    parser.add_argument("--tokenizer", default=str(Path.home() / ".cache" / "afd" / "tiny-qwen3_moe"))
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--profile", help="cProfile the server's event loop into this file (one tree, one run)")
    parser.add_argument("--modes", nargs="+", choices=("one", "split"), default=["one"],
                        help="one: the API in the engine's process; split: in its own (AFD_API_PROCESS)")
    parser.add_argument("--split", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.step_ms, args.tokenizer, args.profile, args.split)
        return 0
    trees = dict(t.split("=", 1) for t in args.tree) if args.tree else {"this": str(REPO / "runtime")}
    variants = {(f"{name}/{mode}" if len(args.modes) > 1 else name): (tree, mode == "split")
                for name, tree in trees.items() for mode in args.modes}
    results = {name: {s: [] for s in args.streams} for name in variants}
    for run in range(args.runs):
        for name, (tree, split) in variants.items():
            server = start_server(tree, args.port, args.step_ms, args.tokenizer, args.profile, split)
            try:
                for streams in args.streams:
                    result = asyncio.run(level(args.port, streams, args.max_tokens, split))
                    results[name][streams].append(result)
                    print(f"run {run} {name} {streams:4d} streams: {result['tok_s']:8.0f} tok/s  "
                          f"{result['cpu_us']:6.1f} CPU µs/token  ITL mean {result['itl_mean']:.1f} ms", flush=True)
            finally:
                server.terminate()
                server.wait(30)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
