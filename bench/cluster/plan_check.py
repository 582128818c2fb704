"""Does `afd plan`'s model predict a live group? Starts `afd up`, steps the load through several
concurrencies (one scrape at the start and one at the end of each phase, while the load is on),
then prints the plan: the last window is steady, so its measured and predicted tokens/s compare.

    .venv/bin/python bench/cluster/plan_check.py [--topology 2A1F] [--phases 2,6,12,8] [--seconds 20]
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

from bench.harness.clients import client_loop, running_up  # noqa: E402


async def phase(api: str, model: str, clients: int, seconds: float, urls: list[str], scrapes: list) -> None:
    from afd.planner.collect import scrape_once

    failures, latencies, counter = [], [], [0]
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients + 4)) as client:
        tasks = [asyncio.create_task(client_loop(client, api, model, deadline, latencies, failures, counter))
                 for _ in range(clients)]
        await asyncio.sleep(2.0)  # ramp: every client has a request in flight
        scrapes.append(await asyncio.to_thread(scrape_once, urls))
        await asyncio.sleep(max(0.0, deadline - time.monotonic() - 0.2))
        scrapes.append(await asyncio.to_thread(scrape_once, urls))
        await asyncio.gather(*tasks)
    if failures:
        raise SystemExit(f"{len(failures)} requests failed: {failures[:3]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="2A1F")
    parser.add_argument("--phases", default="2,6,12,8", help="concurrent streaming clients per phase")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=8135)
    parser.add_argument("--dump", help="write the scrapes to this JSON file")
    parser.add_argument("--log", help="write afd up's log to this file")
    args = parser.parse_args()
    from afd.planner.advice import plan
    from afd.planner.command import render_table

    with running_up(args.topology, args.port, args.log) as (state, model):
        urls = [rank["metrics"] for rank in state["ranks"]]
        scrapes: list = []
        for clients in (int(c) for c in args.phases.split(",")):
            asyncio.run(phase(state["api"], model, clients, args.seconds, urls, scrapes))
            print(f"phase of {clients} clients done", file=sys.stderr, flush=True)
    if args.dump:
        Path(args.dump).write_text(json.dumps([[vars(s) for s in scrape] for scrape in scrapes]))
    result = plan(scrapes)
    print(render_table(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
