"""Sustained-load test: C concurrent streaming clients against `afd up` for D seconds.

    .venv/bin/python bench/serving/load.py --clients 64 --seconds 120

Reports completed and failed requests, p50/p99 request latency, output tokens/s, and
the summed RSS of every rank at the start and the end (growth must stay under 10%).
Exit status 1 if any request failed or RSS grew by more than 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.clients import client_loop, running_up  # noqa: E402

from afd.server.api.api_keys import env_bearer  # noqa: E402


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


async def run_load(api, model, clients, seconds):
    latencies, failures, counter = [], [], [0]
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits, headers=env_bearer()) as client:
        await asyncio.gather(*(client_loop(client, api, model, deadline, latencies, failures, counter) for _ in range(clients)))
    return latencies, failures, counter[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--topology", default="2A1F")
    parser.add_argument("--port", type=int, default=8125)
    args = parser.parse_args()
    with running_up(args.topology, args.port) as (state, model):
        pids = [rank["pid"] for rank in state["ranks"]]
        asyncio.run(run_load(state["api"], model, args.clients, 5))  # warm-up: allocator and caches settle
        rss_start = rss_bytes(pids)
        started = time.monotonic()
        latencies, failures, tokens = asyncio.run(run_load(state["api"], model, args.clients, args.seconds))
        elapsed = time.monotonic() - started
        rss_end = rss_bytes(pids)
    latencies.sort()
    growth = rss_end / rss_start - 1
    print(f"load: {args.clients} clients x {args.seconds:.0f} s against afd up {args.topology}")
    print(f"  requests completed {len(latencies)}, failed {len(failures)}")
    print(f"  latency p50 {statistics.median(latencies):.2f} s, p99 {latencies[int(0.99 * (len(latencies) - 1))]:.2f} s")
    print(f"  output tokens/s {tokens / elapsed:.1f}")
    print(f"  RSS of all ranks: start {rss_start / 2**20:.0f} MiB, end {rss_end / 2**20:.0f} MiB ({100 * growth:+.1f}%)")
    if failures:
        print("  first failures:", failures[:3])
    return 0 if not failures and growth <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
