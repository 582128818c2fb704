"""Serving benchmark: N concurrent streaming clients against `afd up`, versus transformers `generate`.

    .venv/bin/python bench/serving/serve.py --clients 16 --requests 64 --max-tokens 64

Prints output tokens/s, time to first token and inter-token latency (p50/p99) for the
AFD deployment, then the throughput of the same checkpoint through `transformers`
`generate` (one padded batch of `--clients` prompts) and the ratio of the two.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.clients import one_request  # noqa: E402
from bench.harness.measure import percentile  # noqa: E402

from afd.config import process_setting  # noqa: E402
from afd.server.api.api_keys import env_bearer  # noqa: E402


async def drive(api, model, prompts, clients, max_tokens):
    ttfts, itls, queue = [], [], list(prompts)
    async with httpx.AsyncClient(timeout=600, headers=env_bearer()) as client:
        async def worker():
            done = 0
            while queue:
                done += await one_request(client, api, model, queue.pop(), max_tokens, ttfts, itls)
            return done

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(worker() for _ in range(clients))))
        return tokens, time.perf_counter() - started, ttfts, itls


def transformers_throughput(model_path, prompts, batch, max_tokens) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)  # transformers gets the whole machine
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    tokens, started = 0, time.perf_counter()
    for start in range(0, len(prompts), batch):
        encoded = tokenizer(prompts[start : start + batch], return_tensors="pt", padding=True)
        out = model.generate(**encoded, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        tokens += (out.shape[1] - encoded["input_ids"].shape[1]) * out.shape[0]
    return tokens / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: afd up's tiny model)")
    parser.add_argument("--topology", default="2A1F")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()

    prompts = [f"Request {i}: tell me about attention and experts number {i % 7}." for i in range(args.requests)]
    state_file = Path(tempfile.mkdtemp()) / "state.json"
    command = [sys.executable, "-m", "afd", "up", "--topology", args.topology, "--stages", str(args.stages),
               "--port", str(args.port), "--state-file", str(state_file), "--no-demo"]
    if args.model:
        command += ["--model", args.model]
    up = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while not state_file.exists():
            if up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("afd up did not start")
            time.sleep(0.5)
        api = json.loads(state_file.read_text())["api"]
        model = httpx.get(f"{api}/models", headers=env_bearer()).json()["data"][0]["id"]
        model_path = args.model or str(process_setting("AFD_CACHE_DIR") / "tiny-qwen3_moe")  # where afd up made it
        asyncio.run(drive(api, model, prompts[: args.clients], args.clients, 4))  # warm-up
        tokens, seconds, ttfts, itls = asyncio.run(drive(api, model, prompts, args.clients, args.max_tokens))
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    afd_rate = tokens / seconds
    print(f"afd up {args.topology} stages={args.stages}: {args.requests} requests, {args.clients} concurrent, "
          f"{args.max_tokens} tokens each")
    print(f"  output tokens/s      {afd_rate:9.1f}")
    print(f"  TTFT  p50 / p99 (ms) {1e3 * statistics.median(ttfts):9.1f} / {1e3 * percentile(ttfts, 0.99):.1f}")
    print(f"  ITL   p50 / p99 (ms) {1e3 * statistics.median(itls):9.1f} / {1e3 * percentile(itls, 0.99):.1f}")
    hf_rate = transformers_throughput(model_path, prompts, args.clients, args.max_tokens)
    print(f"transformers generate (batch {args.clients}): {hf_rate:9.1f} output tokens/s")
    print(f"ratio afd / transformers: {afd_rate / hf_rate:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
