"""CPU cost of the serving process's output path, per token, with no model: the real app and engine
around a stand-in step.

    PYTHONPATH=runtime .venv/bin/python bench/output_path.py --streams 16 64 256 --runs 3
    # before/after, interleaved: one server per tree and run, alternating
    .venv/bin/python bench/output_path.py --tree main=/work/main/runtime --tree out=runtime
    # one process against the API in its own process (AFD_API_PROCESS), interleaved
    PYTHONPATH=runtime .venv/bin/python bench/output_path.py --modes one split --step-ms 15

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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TEXT = ("The attention layers keep the keys and values of every sequence, while the experts of the feed-forward "
        "layers are shared by all of them; splitting the two lets each side run on the hardware that suits it. ")
STAGES = ("deliver", "detokenize", "stop", "handoff", "format", "write")


# -- server side -------------------------------------------------------------------------------
class Timers:
    """CPU seconds of the calling thread per stage (wall time would count waits for the GIL); wraps
    callables in place, at about a microsecond per call."""

    def __init__(self):
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.present: set[str] = set()

    def wrap(self, owner, name: str, stage: str) -> bool:
        inner = getattr(owner, name, None)
        if inner is None:
            return False
        seconds, clock = self.seconds, time.thread_time

        def timed(*args, **kwargs):
            started = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[stage] += clock() - started

        setattr(owner, name, timed)
        self.present.add(stage)
        return True


def instrument(timers: Timers) -> None:
    """Stage timers on whichever of the known seams this tree has."""
    import json as json_module

    from afd.engine import outputs, text
    from afd.server.api import app

    timers.wrap(outputs.OutputProcessor, "_deliver", "deliver")
    timers.wrap(text.IncrementalDetokenizer, "add", "detokenize")
    timers.wrap(text.StopChecker, "add", "stop")
    timers.wrap(text.StopChecker, "take", "stop")
    for name in ("completion_chunk", "chat_chunk"):  # looked up in app's globals at call time
        timers.wrap(app, name, "format")
    with contextlib.suppress(ImportError):  # a tree that formats each event from a template
        from afd.server.api import sse

        for name in ("completion", "chat", "usage"):
            timers.wrap(sse.StreamEvents, name, "format")
    if hasattr(app, "_Outputs") or hasattr(app, "streams"):  # a tree that takes outputs per request on the loop
        _wrap_handoff(timers, app)
    timers.wrap(asyncio.Queue, "put_nowait", "handoff")  # a tree that hands each output over on its own
    with contextlib.suppress(ImportError):
        from afd.server.api import handoff

        timers.wrap(handoff.LoopHandoff, "_flush", "handoff")  # a tree that hands a step's outputs over at once
    from asyncio import selector_events

    import h11

    timers.wrap(h11.Connection, "send", "write")  # uvicorn's HTTP/1.1 framing, then the socket write
    timers.wrap(selector_events._SelectorSocketTransport, "write", "write")

    class TimedJson:  # app's json.dumps: the SSE line of each chunk
        loads = json_module.loads

        @staticmethod
        def dumps(*args, **kwargs):
            started = time.thread_time()
            try:
                return json_module.dumps(*args, **kwargs)
            finally:
                timers.seconds["format"] += time.thread_time() - started

    app.json = TimedJson


def _wrap_handoff(timers: Timers, app) -> None:
    """Time the callbacks the engine calls with each output (the thread-safe handoff to the loop)."""
    from afd.engine.engine import Engine

    submit = Engine.submit
    seconds, clock = timers.seconds, time.thread_time
    timers.present.add("handoff")

    def timed_submit(self, prompt_ids, params, on_output, *args, **kwargs):
        def timed(*a, **k):
            started = clock()
            try:
                return on_output(*a, **k)
            finally:
                seconds["handoff"] += clock() - started

        return submit(self, prompt_ids, params, timed, *args, **kwargs)

    Engine.submit = timed_submit


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every live thread of this process, by thread name (summed over equal names)."""
    import threading

    result: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, TypeError):
            continue
        name = thread.name.split("_")[0].rstrip("0123456789-")
        result[name] = result.get(name, 0.0) + seconds
    return result


def proc_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of another process: in all, and by thread name as the kernel knows it (`comm`)."""
    tick = os.sysconf("SC_CLK_TCK")
    result: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = "api:" + (task / "comm").read_text().strip().split("/")[0].rstrip("0123456789-")
            result[name] = result.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return result


def child_pids() -> list[int]:
    return [int(pid) for task in Path("/proc/self/task").iterdir() for pid in (task / "children").read_text().split()]


def serve(port: int, step_ms: float, tokenizer_path: str, profile: str | None = None, split: bool = False) -> None:
    import torch
    import uvicorn
    from prometheus_client import CollectorRegistry

    from afd.engine.engine import Engine
    from afd.engine.tokenizer import load_tokenizer
    from afd.kv_cache import KVCache
    from afd.models.spec import KVLayout
    from afd.server.api.app import ServerState, create_app
    from afd.server.front.failover import Failover, FailoverSettings
    from afd.server.serve.serving_metrics import ServingMetrics

    timers = Timers()
    instrument(timers)
    tokenizer = load_tokenizer(tokenizer_path)
    text_ids = torch.tensor(tokenizer.encode(TEXT))
    vocab = len(tokenizer)
    spelled = torch.full((len(text_ids), vocab), -1.0)
    spelled[torch.arange(len(text_ids)), text_ids] = 1.0  # row p: logits whose argmax is the text's token p

    def step(input_ids, layout):
        if step_ms:
            time.sleep(step_ms / 1e3)
        ends = torch.tensor([c + n for c, n in zip(layout.context_lens, layout.new_lens)])
        return spelled[ends % len(text_ids)]  # [sequences, vocab]

    registry = CollectorRegistry()
    metrics = ServingMetrics(registry, 0)
    cache = KVCache([KVLayout(1, 1, 1)], 32768, torch.float32, "cpu")
    engine = Engine(step, cache, tokenizer, [0, 2], 512, 4096, 16384, "cpu", observer=metrics)
    metrics.track(engine)
    state = ServerState(engine=engine, tokenizer=tokenizer, model_name="stand-in", max_model_len=4096, vocab_size=vocab,
                        health=lambda: engine.problem, registry=registry)
    def stats():
        if profile:  # written at every call: uvicorn ends the process by the signal
            profiler.dump_stats(profile)  # which stops it
            profiler.enable()
        threads = {f"core:{k}" if split else k: v for k, v in thread_cpu().items()}
        core = time.process_time()
        api = 0.0
        for pid in child_pids() if split else []:
            for name, seconds in proc_cpu(pid).items():
                threads[name] = threads.get(name, 0.0) + seconds
                api += seconds
        processes = {"proc:core": core, "proc:api": api} if split else {}
        return {"cpu_s": core + api, "threads": {**threads, **processes}, "stages": timers.seconds,
                "present": sorted(timers.present), "tokens": metrics.generation_tokens._value.get()}

    engine.start()
    if split:
        serve_split(port, engine, state, tokenizer_path, stats)
        return
    app = create_app(state)

    @app.get("/bench/stats")
    async def stats_route():  # on the event loop, as the rest of the app
        return stats()
    server = uvicorn.Server(uvicorn.Config(Failover(app, lambda: False, FailoverSettings()),
                                           host="127.0.0.1", port=port, log_level="warning"))
    if profile:  # the event loop's thread, in CPU time (waits for the GIL are not its code's cost)
        import cProfile

        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
    server.run()
    engine.stop()


def serve_split(port: int, engine, state, tokenizer_path: str, stats) -> None:
    """The API in a child process, as `afd serve` with AFD_API_PROCESS=1; the stats on port + 2."""
    import signal
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from afd.config import AFDConfig
    from afd.server.api_process.core import serve_with_api_process
    from afd.server.serve.attention import attention_probes

    class Stats(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps(stats()).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    threading.Thread(target=ThreadingHTTPServer(("127.0.0.1", port + 2), Stats).serve_forever, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    config = AFDConfig(role="monolithic", model=tokenizer_path, api_process=True, http_host="127.0.0.1", http_port=port,
                       metrics_port=port + 1, max_num_seqs=512, max_num_batched_tokens=16384, shutdown_grace_s=5)
    serve_with_api_process(config, stop, state, engine, lambda listening: attention_probes(state, listening, stop))


# -- client side -------------------------------------------------------------------------------
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
    trees = dict(t.split("=", 1) for t in args.tree) if args.tree else {"this": str(Path(__file__).parents[1] / "runtime")}
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
