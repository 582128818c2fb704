"""Steps that carry prompt tokens, eager vs piecewise graphs, DeepSeek-V2-Lite-shaped random bf16 model, one GPU.

    python3 bench/mixed_step.py [--layers 27]     # prints a table, writes $OUT/mixed_step.json

Each row is one step shape: D decode rows at context C beside prompt chunks (the mixed steps chunked
prefill makes), or prompt chunks alone. Columns, medians of --steps steps, each followed by a sync:
- wall ms: launch + device time, what the serving loop waits for;
- host ms: until the call returned (the host's share; with graphs the device runs behind it);
- "eager, gathered": the runtime before this change (decode rows of a mixed step through a padded
  gather + SDPA, every kernel launched from Python);
- "eager": decode rows through the paged decode kernel;
- "piecewise": the same, with everything between two attention kernels replayed from a graph.
The decode-only graph step at the same decode batch is printed for scale.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from common import V2_LITE, random_model, write_json
from decode_steps import kv_cache_for

from afd.models import attention
from afd.models.loader import LoadedModel
from afd.runners.microbatch import SeqLayout
from afd.runners.monolithic import MonolithicRunner

SHAPES = (  # (decode rows, their context, prompt chunk lengths)
    (0, 0, (512,)),
    (0, 0, (1024, 1024)),
    (64, 704, (448,)),
    (256, 704, (256,)),
    (256, 704, (1792,)),
)


def layout_for(kv, decodes: int, context: int, chunks: tuple[int, ...]) -> tuple[SeqLayout, list]:
    tables = [tuple(kv.allocate(context + 1)) for _ in range(decodes)] + [tuple(kv.allocate(n)) for n in chunks]
    layout = SeqLayout(tuple(tables), (context,) * decodes + (0,) * len(chunks), (1,) * decodes + tuple(chunks))
    return layout, tables


def time_step(runner, ids, layout, steps: int, warm: int = 2) -> dict:
    walls, hosts = [], []
    for _ in range(steps + warm):
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = runner(ids, layout)
        launched = time.perf_counter()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
        hosts.append((launched - start) * 1e3)
        del logits
    return {"wall_ms": statistics.median(walls[warm:]), "host_ms": statistics.median(hosts[warm:])}


class GatheredDecodeRows:
    """The attention before this change: a mixed step's decode rows gathered and padded for SDPA."""

    def __enter__(self):
        self.saved = attention.AttentionBatch.__dict__["build"]
        build = attention.AttentionBatch.build
        attention.AttentionBatch.build = classmethod(
            lambda cls, *a, **k: dataclasses.replace(build(*a, **k), single_table=None))

    def __exit__(self, *exc):
        attention.AttentionBatch.build = self.saved

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    config = dict(V2_LITE, num_hidden_layers=args.layers)
    model, spec, crossing = random_model(config)
    kv = kv_cache_for(model, 300, 2048)
    runner = MonolithicRunner(LoadedModel(model, spec, crossing, "random"), kv)
    vocab = config["vocab_size"]
    rows = []
    shapes = [(d, c, chunks, *layout_for(kv, d, c, chunks)) for d, c, chunks in SHAPES]
    with torch.inference_mode():
        for d, c, chunks, layout, _ in shapes:
            ids = torch.randint(0, vocab, (layout.num_tokens,), device="cuda")
            with GatheredDecodeRows():
                gathered = time_step(runner, ids, layout, args.steps)
            rows.append({"decodes": d, "context": c, "chunks": list(chunks), "tokens": layout.num_tokens,
                         "gathered": gathered, "eager": time_step(runner, ids, layout, args.steps)})
            print(f"eager: {rows[-1]}", flush=True)
        started = time.perf_counter()
        runner.capture_graphs(256, max_mixed_tokens=2048)
        capture_s = time.perf_counter() - started
        for row, (d, c, chunks, layout, _) in zip(rows, shapes):
            ids = torch.randint(0, vocab, (layout.num_tokens,), device="cuda")
            row["piecewise"] = time_step(runner, ids, layout, args.steps)
            if d:
                decode, tables = layout_for(kv, d, c, ())
                row["decode_graph"] = time_step(runner, ids[:d], decode, args.steps)
                for table in tables:
                    kv.release(table)
    write_json("mixed_step", {"layers": args.layers, "capture_s": capture_s,
                              "graph_memory_bytes": runner.graphs.memory_bytes, "rows": rows})
    print(f"{args.layers} layers; decode + piecewise graphs captured in {capture_s:.1f} s, "
          f"{runner.graphs.memory_bytes / 2**20:.0f} MiB")
    print(f"{'decodes@ctx':>12} {'chunks':>12} {'tokens':>6} | {'gathered wall/host':>18} | {'eager wall/host':>16} | "
          f"{'piecewise wall/host':>19} | {'eager/piecewise':>15} | {'decode graph':>12}")
    for r in rows:
        cell = lambda t: f"{t['wall_ms']:7.2f}/{t['host_ms']:7.2f}"  # noqa: E731
        decode = f"{r['decode_graph']['wall_ms']:.2f}" if "decode_graph" in r else "-"
        print(f"{r['decodes']:>5}@{r['context']:<6} {'+'.join(map(str, r['chunks'])):>12} {r['tokens']:>6} | "
              f"{cell(r['gathered']):>18} | {cell(r['eager']):>16} | {cell(r['piecewise']):>19} | "
              f"{r['gathered']['wall_ms'] / r['piecewise']['wall_ms']:>15.2f} | {decode:>12}")


if __name__ == "__main__":
    main()
