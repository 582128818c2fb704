"""(d) Decode step with CUDA graphs vs eager, DeepSeek-V2-Lite-shaped random bf16 model on one GPU.

    python3 bench/step/graphs_vs_eager.py     # prints a table, writes $OUT/graphs_vs_eager.json

Each sequence has CONTEXT cached tokens; a step decodes one token per sequence. Step
time is wall-clock around `runner(input_ids, layout)` plus a device sync (what a
serving loop sees), median of STEPS steps.
"""

from __future__ import annotations

import sys
import torch
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.decode_steps import time_steps  # noqa: E402
from bench.harness.measure import require_cuda, write_json  # noqa: E402
from bench.harness.random_weights import random_model  # noqa: E402
from bench.harness.shapes import V2_LITE  # noqa: E402

from afd.kv.cache import KVCache  # noqa: E402
from afd.models.loader import LoadedModel  # noqa: E402
from afd.runners.monolithic_runner import MonolithicRunner  # noqa: E402

BATCHES, CONTEXT, STEPS = (1, 4, 16, 32, 64), 128, 20


def step_ms(runner, kv_cache, batch: int) -> float:
    return time_steps(runner, kv_cache, batch, STEPS, CONTEXT, V2_LITE["vocab_size"])["ms"]


def main() -> None:
    require_cuda(__file__)
    model, spec, crossing = random_model(V2_LITE)
    loaded = LoadedModel(model, spec, crossing, "random")
    kv_cache = KVCache(model.kv_layouts(), 64 * 10, torch.bfloat16, "cuda", block_size=16)
    runner = MonolithicRunner(loaded, kv_cache)
    eager = {b: step_ms(runner, kv_cache, b) for b in BATCHES}
    graphs = runner.capture_graphs(max(BATCHES))
    graphed = {b: step_ms(runner, kv_cache, b) for b in BATCHES}
    rows = [{"batch": b, "eager_ms": eager[b], "graph_ms": graphed[b], "speedup": eager[b] / graphed[b]} for b in BATCHES]
    write_json("graphs_vs_eager", {"context": CONTEXT, "graph_memory_bytes": graphs.memory_bytes, "rows": rows})
    print(f"decode step, DeepSeek-V2-Lite shape (27 layers), context {CONTEXT}, graphs {graphs.memory_bytes / 2**20:.0f} MiB")
    print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'speedup':>8} {'graph tok/s':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['eager_ms']:>9.2f} {r['graph_ms']:>9.2f} {r['speedup']:>8.2f} {r['batch'] / r['graph_ms'] * 1e3:>12.0f}")


if __name__ == "__main__":
    main()
