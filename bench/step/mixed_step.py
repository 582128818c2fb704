"""Steps that carry prompt tokens, eager vs piecewise graphs, DeepSeek-V2-Lite-shaped random bf16 model, one GPU.

    python3 bench/step/mixed_step.py [--layers 27] [--eager-only] [--tag NAME]   # a table; $OUT/mixed_step[-NAME].json

Each row is one step shape: D decode rows at context C beside prompt chunks (the mixed steps chunked
prefill makes), or prompt chunks alone. Columns, medians of --steps steps, each followed by a sync:
- wall ms: launch + device time, what the serving loop waits for;
- host ms: until the call returned (the host's share; with graphs the device runs behind it);
- "eager": every kernel launched from Python;
- "piecewise": everything between two attention kernels replayed from a graph (afd.graphs.mixed).
The decode-only graph step at the same decode batch is printed for scale. `--eager-only` runs on a runtime
without piecewise graphs too (an older checkout on PYTHONPATH), for a before/after in one session.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.decode_steps import kv_cache_for  # noqa: E402
from bench.harness.measure import require_cuda, write_json  # noqa: E402
from bench.harness.random_weights import random_model  # noqa: E402
from bench.harness.shapes import V2_LITE  # noqa: E402

from afd.models.loader import LoadedModel  # noqa: E402
from afd.step.layout import SeqLayout  # noqa: E402
from afd.runners.monolithic_runner import MonolithicRunner  # noqa: E402

SHAPES = (  # (decode rows, their context, prompt chunk lengths)
    (0, 0, (512,)),
    (0, 0, (1024, 1024)),
    (64, 704, (448,)),
    (256, 704, (256,)),
    (256, 704, (1792,)),
    (0, 0, (512,) * 4),  # what a serving step of 2,048 prompt tokens holds: several prompts
    (0, 0, (128,) * 16),
    (64, 300, (256,) * 7),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eager-only", action="store_true")
    parser.add_argument("--tag", default="")
    parser.add_argument("--profile", type=int, default=-1, help="torch.profiler table of one step of SHAPES[N]")
    args = parser.parse_args()
    require_cuda(__file__)
    config = dict(V2_LITE, num_hidden_layers=args.layers)
    model, spec, crossing = random_model(config)
    kv = kv_cache_for(model, 800, 2048)
    runner = MonolithicRunner(LoadedModel(model, spec, crossing, "random"), kv)
    vocab = config["vocab_size"]
    rows, capture_s = [], 0.0
    shapes = [(d, c, chunks, *layout_for(kv, d, c, chunks)) for d, c, chunks in SHAPES]
    with torch.inference_mode():
        for d, c, chunks, layout, _ in shapes:
            ids = torch.randint(0, vocab, (layout.num_tokens,), device="cuda")
            rows.append({"decodes": d, "context": c, "chunks": list(chunks), "tokens": layout.num_tokens,
                         "eager": time_step(runner, ids, layout, args.steps)})
        if not args.eager_only:
            started = time.perf_counter()
            runner.capture_graphs(256, mixed_tokens=2048)
            capture_s = time.perf_counter() - started
            for row, (d, c, chunks, layout, _) in zip(rows, shapes):
                ids = torch.randint(0, vocab, (layout.num_tokens,), device="cuda")
                row["piecewise"] = time_step(runner, ids, layout, args.steps)
                if d:
                    decode, tables = layout_for(kv, d, c, ())
                    row["decode_graph"] = time_step(runner, ids[:d], decode, args.steps)
                    for table in tables:
                        kv.release(table)
        if args.profile >= 0:
            _, _, _, layout, _ = shapes[args.profile]
            ids = torch.randint(0, vocab, (layout.num_tokens,), device="cuda")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                runner(ids, layout)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    memory = runner.graphs.memory_bytes if runner.graphs is not None else 0
    write_json("mixed_step" + (f"-{args.tag}" if args.tag else ""),
               {"layers": args.layers, "capture_s": capture_s, "graph_memory_bytes": memory, "rows": rows})
    print(f"{args.tag or 'this runtime'}: {args.layers} layers; graphs captured in {capture_s:.1f} s, {memory / 2**20:.0f} MiB")
    print(f"{'decodes@ctx':>12} {'chunks':>12} {'tokens':>6} | {'eager wall/host':>16} | {'piecewise wall/host':>19} | "
          f"{'eager/piecewise':>15} | {'decode graph':>12}")
    for r in rows:
        cell = lambda t: f"{t['wall_ms']:7.2f}/{t['host_ms']:7.2f}"  # noqa: E731
        piecewise = cell(r["piecewise"]) if "piecewise" in r else "-"
        ratio = f"{r['eager']['wall_ms'] / r['piecewise']['wall_ms']:.2f}" if "piecewise" in r else "-"
        decode = f"{r['decode_graph']['wall_ms']:.2f}" if "decode_graph" in r else "-"
        print(f"{r['decodes']:>5}@{r['context']:<6} {'+'.join(map(str, r['chunks'])):>12} {r['tokens']:>6} | "
              f"{cell(r['eager']):>16} | {piecewise:>19} | {ratio:>15} | {decode:>12}")


if __name__ == "__main__":
    main()
