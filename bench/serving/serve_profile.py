"""Where the serving process's host time goes under steady load: py-spy samples of the API rank.

Starts the same processes as `bench/serving/serve_gpu.py` (AFD group or monolithic), keeps `--streams`
streams busy (new prompts arrive as others finish), and after `--delay` seconds samples the
API-serving rank with py-spy (`pip install py-spy`): every thread, idle included, then only the
thread holding the GIL. Prints per thread the share of samples and its top frames, and the level's
ITL next to the rank's graph-replayed step; writes the raw stacks to $OUT (or .).

    python3 bench/serving/serve_profile.py --modes afd,monolithic --streams 64
    AFD_SWITCH_INTERVAL_S=0.0005 python3 bench/serving/serve_profile.py ...   # the interpreter's GIL hand-off interval
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path


import httpx  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.random_weights import write_v2_lite  # noqa: E402
from bench.serving.serve_gpu import add_group_arguments, ceilings, drive_level, serving  # noqa: E402

from afd.config import process_setting  # noqa: E402

THREAD_MARKERS = (("engine", "_serve (afd/engine/engine.py"), ("output", "afd/engine/outputs.py"),
                  ("http loop", "run_forever"), ("link", "afd/connector"))


def thread_kind(stack: str) -> str:
    for kind, marker in THREAD_MARKERS:
        if marker in stack:
            return kind
    return "other"


def summarize(raw: Path, top: int = 12) -> str:
    """Per thread kind: share of samples, then its heaviest leaf frames (self) and frames (inclusive)."""
    per_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        kind = thread_kind(stack)
        totals[kind] += int(count)
        per_kind[kind][frames[-1]] += int(count)
        for frame in set(frames[1:]):
            inclusive[kind][frame] += int(count)
    everything = sum(totals.values()) or 1
    lines = []
    for kind, samples in totals.most_common():
        lines.append(f"  [{kind}] {samples} samples ({samples / everything:.0%})")
        lines += [f"      self {n / samples:6.1%}  {frame}" for frame, n in per_kind[kind].most_common(top)]
        lines += [f"      incl {n / samples:6.1%}  {frame}" for frame, n in inclusive[kind].most_common(top)]
    return "\n".join(lines)


def py_spy() -> str:
    """The py-spy program: on PATH, beside this Python, or under an import path (`pip install --target`)."""
    candidates = [shutil.which("py-spy"), Path(sys.executable).parent / "py-spy",
                  *(Path(p) / "bin" / "py-spy" for p in sys.path if p)]
    return next((str(c) for c in candidates if c and Path(c).exists()), "py-spy")


def record(pid: int, seconds: float, path: Path, *flags: str) -> None:
    done = subprocess.run([py_spy(), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200",
                           "--format", "raw", "--threads", "--nonblocking", "-o", str(path), *flags],
                          capture_output=True, text=True)
    if done.returncode:
        print(f"py-spy failed ({done.returncode}): {done.stderr[-800:]}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_group_arguments(parser)
    parser.add_argument("--modes", default="afd,monolithic")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-tokens", default="128,1024", type=lambda s: tuple(int(x) for x in s.split(",")))
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--requests-per-stream", type=int, default=6)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--delay", type=float, default=15, help="seconds of load before sampling")
    parser.add_argument("--seconds", type=float, default=8, help="seconds of each py-spy recording")
    parser.add_argument("--start-timeout", type=float, default=600)
    args = parser.parse_args()
    args.levels = [args.streams]
    model = args.model or str(write_v2_lite(Path(args.checkpoint_dir) / f"v2lite-{args.layers}", args.layers, args.device))
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    interval = process_setting("AFD_SWITCH_INTERVAL_S") or "default"  # as `afd serve` reads it
    for mode in args.modes.split(","):
        with serving(mode, args, model) as (processes, envs, api):
            step = ceilings(api).get(args.streams)
            served = httpx.get(f"{api}/v1/models").json()["data"][0]["id"]
            vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
            pid = processes.children["api"].pid
            tag = f"{mode}-{args.streams}-si{interval}"
            recordings = [(out / f"{tag}-all.txt", ("--idle",)), (out / f"{tag}-gil.txt", ("--gil",))]

            def sample_later():
                time.sleep(args.delay)
                for path, flags in recordings:
                    record(pid, args.seconds, path, *flags)

            sampler = threading.Thread(target=sample_later)
            sampler.start()
            level = asyncio.run(drive_level(f"{api}/v1", served, args.streams, args, random.Random(0), vocab))
            sampler.join()
            step_ms = 1e3 * step if step else float("nan")
            print(f"\n{tag}: ITL p50 {level['itl_p50_ms']:.1f} ms, p99 {level['itl_p99_ms']:.1f} ms, "
                  f"graph-replayed step {step_ms:.1f} ms, {level['tokens_per_s']:.0f} tok/s, "
                  f"{level['failed']} failed, {level['seconds']:.0f} s", flush=True)
            for path, flags in recordings:
                if path.exists():
                    print(f" {path.name} ({' '.join(flags)}):\n{summarize(path)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
