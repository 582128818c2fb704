"""Serving benchmark: `afd up` (our engine) vs vLLM attention + our FFN ranks vs plain vLLM.

    .venv/bin/python bench/comparisons/vllm_compare.py --topology 1A1F --clients 8 --requests 32 --max-tokens 32

Same tiny checkpoint (Qwen3-MoE, head_dim 32 for vLLM's CPU attention), same prompts,
same concurrency, float32, greedy, `ignore_eos`. Each system gets the whole machine in
turn; its ranks share the cores evenly (OMP_NUM_THREADS). vLLM runs from its own venv
(`scripts/install_vllm.sh`, or `--vllm-python`). Prints output tokens/s, TTFT and ITL
(p50/p99) side by side, plus the start-up time and whether the greedy text of one
prompt agrees across the three.
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

VLLM_ENV = {"VLLM_NO_USAGE_STATS": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}


class Launched:
    """Processes of one system, their API URLs (one per attention rank) and log files."""

    def __init__(self, workdir: Path):
        self.workdir, self.children, self.apis = workdir, [], []

    def start(self, name: str, command: list[str], env: dict[str, str]) -> None:
        log = open(self.workdir / f"{name}.log", "wb")
        self.children.append(subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
        log.close()

    def wait_healthy(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        for api in self.apis:
            while True:
                if any(child.poll() is not None for child in self.children):
                    raise SystemExit(f"a process exited during start-up; logs in {self.workdir}")
                try:
                    if httpx.get(api.removesuffix("/v1") + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"{api} not healthy within {timeout_s:.0f} s; logs in {self.workdir}")
                time.sleep(0.5)

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
        for child in self.children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)


def threads(ranks: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}


def launch_afd_up(model: str, topology: str, stages: int, port: int, workdir: Path) -> Launched:
    launched = Launched(workdir)
    state = workdir / "state.json"
    launched.start("afd-up", [sys.executable, "-m", "afd", "up", "--model", model, "--topology", topology, "--stages",
                              str(stages), "--port", str(port), "--state-file", str(state), "--no-demo"], {})
    deadline = time.monotonic() + 600
    while not state.exists() or "api" not in json.loads(state.read_text() or "{}"):
        if launched.children[0].poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"afd up did not start; log in {workdir}")
        time.sleep(0.5)
    launched.apis = [json.loads(state.read_text())["api"]]
    return launched


def launch_vllm_attention(model: str, topology: str, stages: int, port: int, vllm_python: str, workdir: Path) -> Launched:
    from afd.config import AFDConfig, config_to_env, values_from_topology
    from afd.local.group_processes import local_zmq_config
    from afd.local.children import free_port_block

    config = local_zmq_config(AFDConfig(model=model, stages=stages, dtype="float32", device="cpu", http_host="127.0.0.1",
                                        attention_engine="vllm", **values_from_topology(topology)))
    ranks = config.topology
    share = threads(ranks.num_attention + ranks.num_ffn)
    launched, metrics = Launched(workdir), free_port_block(ranks.num_ffn)
    for rank in range(ranks.num_ffn):
        env = config_to_env(config.replace(role="ffn", rank=rank, metrics_port=metrics + rank))
        launched.start(f"ffn-{rank}", [sys.executable, "-m", "afd", "serve"], {**env, **share})
    for rank in range(ranks.num_attention):
        env = config_to_env(config.replace(role="attention", rank=rank, http_port=port + rank, served_model_name="tiny"))
        launched.start(f"vllm-attention-{rank}", [vllm_python, "-m", "afd.vllm_plugin.serve"], {**env, **share, **VLLM_ENV})
        launched.apis.append(f"http://127.0.0.1:{port + rank}/v1")
    return launched


def launch_vllm(model: str, port: int, vllm_python: str, workdir: Path, omp_threads: int | None) -> Launched:
    launched = Launched(workdir)
    launched.start("vllm", [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
                            "--port", str(port), "--served-model-name", "tiny", "--dtype", "float32",
                            "--max-num-seqs", "64", "--max-num-batched-tokens", "8192"],
                    {**(threads(1) if omp_threads is None else {"OMP_NUM_THREADS": str(omp_threads)}), **VLLM_ENV})
    launched.apis = [f"http://127.0.0.1:{port}/v1"]
    return launched


async def drive(apis: list[str], prompts: list[str], clients: int, max_tokens: int):
    """`clients` streaming clients; client i talks to attention rank i mod len(apis)."""
    ttfts, itls, queue = [], [], list(prompts)
    async with httpx.AsyncClient(timeout=600) as client:
        models = [(await client.get(f"{api}/models")).json()["data"][0]["id"] for api in apis]

        async def worker(index: int) -> int:
            api, model, done = apis[index % len(apis)], models[index % len(apis)], 0
            while queue:
                done += await one_request(client, api, model, queue.pop(), max_tokens, ttfts, itls)
            return done

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(worker(i) for i in range(clients))))
        return tokens, time.perf_counter() - started, ttfts, itls


def greedy_text(api: str, prompt: str) -> str:
    model = httpx.get(f"{api}/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{api}/completions", json=body, timeout=120).json()["choices"][0]["text"]


def measure(name: str, launch, args, prompts: list[str]) -> dict:
    started = time.perf_counter()
    launched = launch()
    try:
        launched.wait_healthy()
        startup = time.perf_counter() - started
        text = greedy_text(launched.apis[0], prompts[0])
        asyncio.run(drive(launched.apis, prompts[: args.clients], args.clients, 4))  # warm-up
        tokens, seconds, ttfts, itls = asyncio.run(drive(launched.apis, prompts, args.clients, args.max_tokens))
    finally:
        launched.stop()
    row = {"system": name, "startup_s": startup, "tokens": tokens, "tokens_per_s": tokens / seconds,
           "ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_p99_ms": 1e3 * percentile(ttfts, 0.99),
           "itl_p50_ms": 1e3 * statistics.median(itls), "itl_p99_ms": 1e3 * percentile(itls, 0.99), "text": text}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: a tiny qwen3_moe with head_dim 32, made here)")
    parser.add_argument("--topology", default="1A1F")
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--systems", default="afd,vllm-attention,vllm")
    parser.add_argument("--vllm-omp-threads", type=int, help="plain vLLM's OMP_NUM_THREADS (default: every core)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="afd-vllm-bench-"))
    model = args.model
    if not model:
        from afd.checkpoint_tools.tiny import make_tiny_model

        model = str(make_tiny_model("qwen3_moe", root / "tiny-qwen3_moe", seed=0, overrides={"head_dim": 32}))
    prompts = [f"Request {i}: tell me about attention and experts number {i % 7}." for i in range(args.requests)]
    launchers = {
        "afd": lambda: launch_afd_up(model, args.topology, args.stages, args.port, root),
        "vllm-attention": lambda: launch_vllm_attention(model, args.topology, args.stages, args.port, args.vllm_python, root),
        "vllm": lambda: launch_vllm(model, args.port, args.vllm_python, root, args.vllm_omp_threads),
    }
    rows = [measure(name, launchers[name], args, prompts) for name in args.systems.split(",")]
    print(f"\n{args.requests} requests, {args.clients} concurrent, {args.max_tokens} tokens each, "
          f"{args.topology} stages={args.stages} (plain vLLM: one process), {os.cpu_count()} cores, float32")
    print(f"{'system':16} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'start s':>8}")
    for r in rows:
        print(f"{r['system']:16} {r['tokens_per_s']:8.1f} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:9.1f} "
              f"{r['itl_p50_ms']:8.1f} {r['itl_p99_ms']:8.1f} {r['startup_s']:8.1f}")
    texts = {r["text"] for r in rows}
    print("greedy text of prompt 0:", "identical across systems" if len(texts) == 1 else f"DIFFERS: {[r['text'] for r in rows]}")
    print(f"logs: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
