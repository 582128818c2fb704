"""Record the attention ranks' serving series of one `afd up` group at fixed load levels.

    .venv/bin/python bench/cluster/record_slo_trace.py --levels 0,1,2,4,8,16 --seconds 24 --interval 3 \
        --out tests/operator/traces/cpu-2A1F-levels.json

For each level, C streaming clients (bench/harness/clients.py's `client_loop`) run for the given seconds while every
attention rank's /metrics is scraped each interval; the scrapes keep only the series
spec.autoscaling reads (afd_operator.autoscaler.signals.SERIES). The autoscaler's simulation tests
(tests/operator/test_autoscale_sim.py) replay these scrapes: a group carrying C streams is
assumed to look like the recorded group at level C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime"), str(REPO / "operator")]  # `bench`, this checkout's `afd` and `afd_operator`

from bench.harness.clients import client_loop, running_up  # noqa: E402

from afd_operator.autoscaler.signals import SERIES  # noqa: E402


def keep(line: str) -> bool:
    return any(line.startswith(name + "{") for name in SERIES)


def scrape(urls: list[str]) -> str:
    lines = []
    with httpx.Client(timeout=10) as client:
        for url in urls:
            lines += [line for line in client.get(url).text.splitlines() if keep(line)]
    return "\n".join(lines) + "\n"


async def load_for(api: str, model: str, clients: int, seconds: float) -> int:
    if clients == 0:
        await asyncio.sleep(seconds)
        return 0
    latencies, failures, counter = [], [], [0]
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=clients + 4)) as client:
        await asyncio.gather(*(client_loop(client, api, model, deadline, latencies, failures, counter)
                               for _ in range(clients)))
    return len(failures)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="0,1,2,4,8,16")
    parser.add_argument("--seconds", type=float, default=24)
    parser.add_argument("--interval", type=float, default=3)
    parser.add_argument("--topology", default="2A1F")
    parser.add_argument("--port", type=int, default=8137)
    parser.add_argument("--out", required=True)
    parser.add_argument("--log", help="afd up's stderr goes here (default: discarded)")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    record = {"command": " ".join(["bench/cluster/record_slo_trace.py", *sys.argv[1:]]), "topology": args.topology,
              "interval_s": args.interval, "levels": []}
    with running_up(args.topology, args.port, args.log) as (state, model):
        urls = [rank["metrics"] for rank in state["ranks"] if rank.get("role") == "attention"]
        asyncio.run(load_for(state["api"], model, 2, 5))  # warm-up: first compiles and allocations
        for clients in levels:
            scrapes: list[dict] = []
            stop = threading.Event()

            def scraper() -> None:
                while not stop.is_set():
                    scrapes.append({"at": round(time.time(), 3), "text": scrape(urls)})
                    stop.wait(args.interval)

            thread = threading.Thread(target=scraper, daemon=True)
            thread.start()
            failed = asyncio.run(load_for(state["api"], model, clients, args.seconds))
            stop.set()
            thread.join()
            print(f"level {clients}: {len(scrapes)} scrapes, {failed} failed requests", flush=True)
            record["levels"].append({"clients": clients, "failed": failed, "scrapes": scrapes})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=None, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
