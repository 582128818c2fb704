"""Step-time overhead of per-layer metrics: profiling every N-th step vs never.

    .venv/bin/python bench/step/metrics_overhead.py [--model PATH] [--steps 400] [--every 16]

Runs one loopback AFD group (1A1F, both roles instrumented exactly as `afd serve` does)
decoding a batch of 16 sequences in blocks of `--every` steps (each "on" block holds
exactly one profiled step), alternating metrics off and on block by block, and prints
the median block time of each and their ratio (target: < 2% overhead).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from afd.config import AFDConfig  # noqa: E402
from afd.metrics.layer_clock import LayerClock, NullClock  # noqa: E402
from afd.metrics.layer_metrics import LayerMetrics  # noqa: E402
from afd.roles.attention import build_attention  # noqa: E402
from afd.roles.ffn import build_ffn  # noqa: E402
from afd.step.layout import SeqLayout  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: afd up's tiny model)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    if args.model is None:
        from afd.local.up import ensure_tiny_model

        args.model = str(ensure_tiny_model())
    config = AFDConfig(connector="loopback", model=args.model, ffn_address_template="overhead", profile_every=args.every)
    ffn = build_ffn(config.replace(role="ffn"))
    stop = threading.Event()
    threading.Thread(target=ffn.serve, args=(stop,), daemon=True).start()
    role = build_attention(config, cache_tokens=args.batch * (args.steps + 64))
    runner = role.runner
    registry = CollectorRegistry()
    clocks = {
        "on": (LayerClock("cpu", args.every), LayerClock("cpu", args.every)),
        "off": (NullClock(), NullClock()),
    }
    runner.on_layers = LayerMetrics(registry, "attention", 0).observe
    ffn.on_layers = LayerMetrics(CollectorRegistry(), "ffn", 0).observe  # one registry per process in production
    tables = tuple(tuple(role.kv_cache.allocate(args.steps + 8)) for _ in range(args.batch))
    ids = torch.randint(0, role.loaded.spec.vocab_size, (args.batch,))
    times = {"on": [], "off": []}
    torch.set_num_threads(1)  # fewer threads, less noise on a shared machine
    blocks = args.steps // args.every
    with torch.inference_mode():
        for block in range(blocks):
            mode = "on" if block % 2 else "off"
            runner.clock, ffn.clock = clocks[mode]
            started = time.perf_counter()
            for step in range(args.every):
                position = block * args.every + step
                runner(ids, SeqLayout(tables, (position,) * args.batch, (1,) * args.batch))
            times[mode].append(time.perf_counter() - started)
    role.close()
    stop.set()
    off, on = statistics.median(times["off"][1:]), statistics.median(times["on"][1:])
    print(f"decode steps of {args.batch} sequences, 1A1F loopback, per-layer profiling every {args.every} steps")
    print(f"  metrics off: median {off / args.every * 1e3:.3f} ms per step ({len(times['off'])} blocks of {args.every})")
    print(f"  metrics on : median {on / args.every * 1e3:.3f} ms per step ({len(times['on'])} blocks of {args.every})")
    print(f"  overhead   : {100 * (on / off - 1):+.2f}% (end to end; on a busy machine this is within the noise)")
    cost = instrumentation_cost(len(role.loaded.crossing), config.stages)
    print(f"  instrumentation alone: {cost * 1e6:.1f} us per profiled step = "
          f"{100 * cost / args.every / (off / args.every):.3f}% of a step at 1 profiled step in {args.every}")


def instrumentation_cost(layers: int, stages: int, repeats: int = 2000) -> float:
    """Seconds of marks + collection + histogram updates for one profiled step, timed in isolation."""
    clock, metrics = LayerClock("cpu", 1), LayerMetrics(CollectorRegistry(), "attention", 0)
    started = time.perf_counter()
    for _ in range(repeats):
        clock.begin(True)
        for layer in range(layers):
            for _ in range(stages):
                for kind in ("recv", "compute", "send"):
                    clock.lap(kind, layer, clock.now())
        metrics.observe(clock.collect())
    return (time.perf_counter() - started) / repeats
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
