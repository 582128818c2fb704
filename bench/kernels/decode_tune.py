"""Paged decode attention against its byte floor: key slices and launch settings swept per batch and context.

For the MLA latent kernel (DeepSeek-V2-Lite: 16 heads over one 576-wide latent row; DeepSeek-V3: 128 heads) and the
grouped-query kernel (Qwen3-30B-A3B: 32 query heads on 4 key heads of 128), at each batch and context: the default
(`plan_splits`, `latent_launch` / `gqa_launch`) and every (slices, rows a step, warps, stages) of the sweep,
each the median of graph replays; the cache is read through shuffled block tables over copies that together
outgrow L2, so every call reads its keys from HBM. Prints µs and ÷ the floor (the KV bytes at the measured copy rate).
`python3 bench/kernels/decode_tune.py [--shapes ...] [--batches 32,64,128,256] [--contexts 1024,4096]`
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import asdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import ceilings, require_cuda, time_graph, write_json  # noqa: E402

SHAPES = {  # kind, query heads, key heads, key width (latent: latent + rope), value width (latent: latent)
    "deepseek-v2-lite": ("latent", 16, 1, 576, 512),
    "deepseek-v3": ("latent", 128, 1, 576, 512),
    "qwen3-30b-a3b": ("gqa", 32, 4, 128, 128),
}
BLOCK = 16
L2_FLUSH_BYTES = 256 * 2**20


def kv_bytes(shape: str, batch: int, context: int) -> int:
    kind, _, kv_heads, dk, dv = SHAPES[shape]
    return batch * context * kv_heads * (dk if kind == "latent" else dk + dv) * 2


def make_call(shape: str, batch: int, context: int):
    """A callable (splits, launch) -> None running the kernel over `copies` disjoint caches, and `copies`."""
    from afd.kernels.decode_attention import paged_decode_attention, paged_latent_decode_attention

    kind, heads, kv_heads, dk, dv = SHAPES[shape]
    copies = max(1, min(16, -(-L2_FLUSH_BYTES // kv_bytes(shape, batch, context))))
    width = -(-context // BLOCK)
    blocks = copies * batch * width
    order = torch.randperm(blocks, device="cuda").to(torch.int32)
    tables = [order[i * batch * width:(i + 1) * batch * width].view(batch, width) for i in range(copies)]
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dk, device="cuda", dtype=torch.bfloat16)
    scale = dk ** -0.5
    if kind == "latent":
        cache = torch.randn(blocks * BLOCK, 1, dk, device="cuda", dtype=torch.bfloat16)

        def call(splits, launch):
            for table in tables:
                paged_latent_decode_attention(q, cache, dv, table, lens, BLOCK, scale, splits=splits, launch=launch)
    else:
        cache_k = torch.randn(blocks * BLOCK, kv_heads, dk, device="cuda", dtype=torch.bfloat16)
        cache_v = torch.randn(blocks * BLOCK, kv_heads, dv, device="cuda", dtype=torch.bfloat16)

        def call(splits, launch):
            for table in tables:
                paged_decode_attention(q, cache_k, cache_v, table, lens, BLOCK, scale, splits=splits, launch=launch)
    return call, copies


def sweep(shape: str, batch: int, context: int, splits_list, launches, copy_rate: float) -> dict:
    from afd.kernels.decode_attention import default_splits, gqa_launch, latent_launch

    kind, heads, kv_heads, _, _ = SHAPES[shape]
    if kind == "latent":
        per_program, measured = latent_launch(heads, torch.bfloat16)
        programs = batch * -(-heads // per_program)
    else:
        measured, programs = gqa_launch(torch.bfloat16), batch * kv_heads
    call, copies = make_call(shape, batch, context)
    floor_us = kv_bytes(shape, batch, context) / copy_rate * 1e6

    def timed(splits, launch):
        try:
            return time_graph(lambda: call(splits, launch), iters=20) * 1e3 / copies
        except Exception as error:  # a setting over the multiprocessor's shared memory or registers
            if "OutOfResources" not in type(error).__name__ and "out of resource" not in str(error):
                raise
            return None

    default = timed(None, None)
    results = []
    for splits, launch in itertools.product(splits_list, launches):
        us = timed(splits, launch)
        if us is not None:
            results.append({"splits": splits, **asdict(launch), "us": us})
    if not results:
        raise SystemExit(f"{shape} batch {batch} context {context}: no swept setting fits the GPU (shared memory or "
                         "registers); sweep smaller --block-n or --stages")
    best = min(results, key=lambda r: r["us"])
    splits = default_splits(programs, torch.device("cuda"), measured.programs_per_multiprocessor)
    row = {"shape": shape, "batch": batch, "context": context, "programs": programs, "default_splits": splits,
           "floor_us": floor_us, "default_us": default, "best": best, "results": results}
    print(f"{shape:<17} b {batch:>4} ctx {context:>5}  floor {floor_us:8.1f} us  default {default:8.1f} us "
          f"(÷ {default / floor_us:4.2f}, {row['default_splits']} slices)  best {best['us']:8.1f} us "
          f"(÷ {best['us'] / floor_us:4.2f}: {best['splits']} slices, {best['block_n']} rows, "
          f"{best['num_warps']} warps, {best['num_stages']} stages)  default ÷ best {default / best['us']:4.2f}",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="deepseek-v2-lite,qwen3-30b-a3b")
    parser.add_argument("--batches", default="32,64,128,256")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--splits", default="1,2,3,4,6,8,12,16")
    parser.add_argument("--block-n", default="32,64")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3,4")
    args = parser.parse_args()
    require_cuda(__file__)
    from afd.kernels.decode_attention import DecodeLaunch

    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    launches = [DecodeLaunch(n, w, s)  # slices are swept, so programs_per_multiprocessor plays no part
                for n, w, s in itertools.product(ints(args.block_n), ints(args.warps), ints(args.stages))]
    copy_rate = ceilings()["copy_bytes_per_s"]
    print(f"copy rate {copy_rate / 1e12:.2f} TB/s; {len(launches)} launch settings × {len(ints(args.splits))} "
          "slice counts")
    rows = [sweep(shape, batch, context, ints(args.splits), launches, copy_rate)
            for shape in args.shapes.split(",") for context in ints(args.contexts) for batch in ints(args.batches)]
    write_json("decode_tune", {"copy_bytes_per_s": copy_rate, "rows": rows})
    print("\nbest time per slice count (any launch), µs:")
    for row in rows:
        per = {}
        for r in row["results"]:
            per[r["splits"]] = min(per.get(r["splits"], float("inf")), r["us"])
        print(f"{row['shape']:<17} b {row['batch']:>4} ctx {row['context']:>5}  "
              + "  ".join(f"{s}:{us:.0f}" for s, us in sorted(per.items())))


if __name__ == "__main__":
    main()
