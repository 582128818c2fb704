"""Automatic prefix caching (issue 51) on a local deployment (`afd up`), caching on vs off: a multi-turn chat replay,
a shared-system-prompt workload, and a workload with no sharing (the overhead). Prints, per workload and setting, TTFT
p50/p99, output tokens/s and the prefix-cache hit rate (cached / prompt tokens, from each answer's streamed usage).
Default: a tiny CPU model (random weights, fp32), one attention rank; on GPUs pass `--model` and the ranks'
settings as `AFD_*` variables (`afd up` hands them on).

    .venv/bin/python bench/serving/prefix_cache.py --repeats 2                         # CPU, tiny qwen3_moe
    python3 bench/harness/random_weights.py --out /tmp/ck/v2lite --layers 27     # DeepSeek-V2-Lite shapes
    AFD_DEVICE=cuda AFD_DTYPE=bfloat16 AFD_CUDA_GRAPHS=true python3 bench/serving/prefix_cache.py \
        --model /tmp/ck/v2lite --monolithic --prefix 2048 --streams 16,64 --vocab 30000 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import percentile, write_json  # noqa: E402
from afd.local.children import free_port_block  # noqa: E402


@dataclass
class Tally:
    """What one workload's answers measured."""

    ttfts: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0

    def row(self) -> dict:
        return {"ttft_p50_ms": 1e3 * percentile(self.ttfts, 0.5), "ttft_p99_ms": 1e3 * percentile(self.ttfts, 0.99),
                "tokens_per_s": self.output_tokens / self.seconds if self.seconds else 0.0,
                "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "requests": len(self.ttfts)}


async def streamed(client, url: str, body: dict, tally: Tally) -> str:
    """One streamed request: its TTFT, tokens and usage go into `tally`; its text is returned."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True}
    started, first, text = time.perf_counter(), None, ""
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if first is None:
                    first = time.perf_counter()
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if chunk.get("usage"):
                usage = chunk["usage"]
                tally.output_tokens += usage["completion_tokens"]
                tally.prompt_tokens += usage["prompt_tokens"]
                tally.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    tally.ttfts.append((first or time.perf_counter()) - started)
    return text


async def chat_replay(api, model, args, rng) -> Tally:
    """`streams` conversations at once, `turns` turns each: every turn sends the whole conversation so far."""
    tally, words = Tally(), ["river", "stone", "lamp", "cloud", "maple", "signal", "harbor", "copper", "meadow", "orbit"]
    system = " ".join(rng.choice(words) for _ in range(args.prefix // 2))

    async def conversation(client, index):
        messages = [{"role": "system", "content": system}]
        for turn in range(args.turns):
            question = " ".join(rng.choice(words) for _ in range(args.question)) + f" ({index}.{turn})"
            messages.append({"role": "user", "content": question})
            answer = await streamed(client, f"{api}/chat/completions",
                                    {"model": model, "messages": messages, "max_tokens": args.tokens}, tally)
            messages.append({"role": "assistant", "content": answer})

    return await timed(tally, conversation, args.streams)


async def shared_system(api, model, args, rng, shared: bool = True) -> Tally:
    """`streams` clients, `turns` requests each: one `prefix`-token system prompt (or, unshared, each request its
    own random one) and a `question`-token question."""
    tally = Tally()
    system = [rng.randrange(20, args.vocab) for _ in range(args.prefix)]

    async def client_of(client, index):
        for turn in range(args.turns):
            head = system if shared else [rng.randrange(20, args.vocab) for _ in range(args.prefix)]
            prompt = head + [rng.randrange(20, args.vocab) for _ in range(args.question)]
            await streamed(client, f"{api}/completions", {"model": model, "prompt": prompt, "max_tokens": args.tokens},
                           tally)

    return await timed(tally, client_of, args.streams)


async def timed(tally: Tally, client_of, streams: int) -> Tally:
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_of(client, index) for index in range(streams)))
        tally.seconds = time.perf_counter() - started
    return tally


def start_up(args, caching: bool, port: int, log: Path):
    """`afd up` with prefix caching on or off; (process, API URL, model id) once it serves."""
    state_file = Path(tempfile.mkdtemp()) / "state.json"
    command = [sys.executable, "-m", "afd", "up", "--topology", args.topology, "--stages", str(args.stages),
               "--port", str(port), "--state-file", str(state_file), "--no-demo",
               "--prefix-caching" if caching else "--no-prefix-caching"]
    if args.model:
        command += ["--model", args.model]
    if args.monolithic:
        command += ["--monolithic"]
    up = subprocess.Popen(command, stderr=open(log, "w"), stdout=subprocess.DEVNULL)
    while not state_file.exists():
        if up.poll() is not None:
            raise SystemExit(f"afd up did not start: see {log}")
        time.sleep(0.5)
    api = json.loads(state_file.read_text())["api"]
    return up, api, httpx.get(f"{api}/models").json()["data"][0]["id"]


def median_row(rows: list[dict]) -> dict:
    """Each figure's median over the repeats of one workload and setting."""
    return {key: statistics.median(row[key] for row in rows) for key in ("ttft_p50_ms", "ttft_p99_ms", "tokens_per_s",
                                                                          "hit_rate")}


WORKLOADS = {"chat_replay": chat_replay, "shared_system": shared_system,
             "no_sharing": lambda api, model, args, rng: shared_system(api, model, args, rng, shared=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: afd up's tiny qwen3_moe)")
    parser.add_argument("--topology", default="1A1F")
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--monolithic", action="store_true", help="one process, the FFN local (afd up --monolithic)")
    parser.add_argument("--streams", default="8", help="concurrent clients, comma-separated for several runs")
    parser.add_argument("--turns", type=int, default=4, help="requests per client (chat: turns of a conversation)")
    parser.add_argument("--prefix", type=int, default=512, help="shared system prompt tokens (chat: ~words)")
    parser.add_argument("--question", type=int, default=24, help="tokens (chat: words) of each request's own part")
    parser.add_argument("--tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--vocab", type=int, default=250, help="token ids drawn below this (the tiny model's vocabulary)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="deployments per setting, alternating on and off (a shared machine's load moves single runs)")
    args = parser.parse_args()
    results, logs = [], Path(tempfile.mkdtemp(prefix="prefix-cache-bench-"))
    for repeat, caching in [(r, c) for r in range(args.repeats) for c in (True, False)]:
        up, api, model = start_up(args, caching, free_port_block(1), logs / f"up-{caching}-{repeat}.log")
        try:
            asyncio.run(shared_system(api, model, argparse.Namespace(**{**vars(args), "streams": 1, "turns": 1}),
                                      random.Random(-1), shared=False))  # warm-up
            for streams in map(int, args.streams.split(",")):
                for name in args.workloads.split(","):
                    rng = random.Random(args.seed)  # both settings replay the same requests
                    run_args = argparse.Namespace(**{**vars(args), "streams": streams})
                    row = {"workload": name, "streams": streams, "caching": caching,
                           **asyncio.run(WORKLOADS[name](api, model, run_args, rng)).row()}
                    results.append(row)
                    print(f"{name:>13} streams={streams:<3} caching={'on ' if caching else 'off'} "
                          f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms  p99 {row['ttft_p99_ms']:8.1f} ms  "
                          f"{row['tokens_per_s']:8.1f} tok/s  hit rate {100 * row['hit_rate']:5.1f} %", flush=True)
        finally:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=60)
    for name in args.workloads.split(","):
        for streams in map(int, args.streams.split(",")):
            on, off = (median_row([r for r in results if r["workload"] == name and r["streams"] == streams
                                   and r["caching"] == c]) for c in (True, False))
            print(f"{name:>13} streams={streams:<3} caching on/off (median of {args.repeats}): TTFT p50 "
                  f"{on['ttft_p50_ms']:.0f}/{off['ttft_p50_ms']:.0f} ms x{on['ttft_p50_ms'] / off['ttft_p50_ms']:.2f}, "
                  f"p99 {on['ttft_p99_ms']:.0f}/{off['ttft_p99_ms']:.0f} ms, tokens/s {on['tokens_per_s']:.1f}/"
                  f"{off['tokens_per_s']:.1f} x{on['tokens_per_s'] / off['tokens_per_s']:.3f}, hit rate "
                  f"{100 * on['hit_rate']:.1f} %", flush=True)
    write_json("prefix_cache", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
