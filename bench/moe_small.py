"""The small-token MoE path (`afd.kernels.moe_small`) vs the aligned Triton path at a few tokens, CUDA-graph replays.

    python3 bench/moe_small.py          # 3 shapes × T = 1, 2, 4, 8: a table; writes $OUT/moe_small.json
    python3 bench/moe_small.py --shapes deepseek-v3 --tokens 1,2 --variants 1,2 --deadline 50

Shapes (bench/common.py's MOE_SHAPES): deepseek-v2-lite and qwen3-30b-a3b in bf16, deepseek-v3 in FP8 (e4m3
with 128×128 block scales, `quantize_block_fp8` of random weights). The experts alone (gate_up and down stacks,
shared experts folded in as the last ones) on a random greedy top-k routing. `aligned ms`: `moe.experts_triton`
with `AFD_MOE_SMALL_TOKENS=0` (FP8: the tokens' quantization, alignment, two GEMMs, slot sum, with the tuned
table where one ships); `small ms`: `moe_small.experts_small` with its default block settings. Floor = bytes of the
expert weights touched (distinct routed experts + shared, FP8 scales included) / the measured copy rate (bytes
read + written per second, as moe_layer.py's floor). `rel err`: small vs aligned, by norm. `--variants T,..`
also times the other block settings in `VARIANTS` at those token counts (a line under the row) and names the
fastest. `--deadline S` starts no shape or token count after S seconds (what is done is printed and written).
Without a CUDA GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from common import MOE_SHAPES, ceilings, require_cuda, time_graph, write_json

DEVICE = "cuda"
SHAPES = ("deepseek-v2-lite", "qwen3-30b-a3b", "deepseek-v3")
FP8_SHAPES = {"deepseek-v3"}


def settings(up_n: int, up_k: int, up_warps: int, down_n: int, down_k: int, down_warps: int) -> dict:
    return {"gate_up": {"BLOCK_N": up_n, "BLOCK_K": up_k, "num_warps": up_warps},
            "down": {"BLOCK_N": down_n, "BLOCK_K": down_k, "num_warps": down_warps}}


VARIANTS = {  # name → block settings besides the defaults; FP8 ones keep BLOCK_K a multiple of 128
    False: {"n32k256": settings(32, 256, 4, 32, 256, 4), "n8k512": settings(8, 512, 4, 8, 512, 4),
            "n16k512w8": settings(16, 512, 8, 16, 512, 8)},
    True: {"up32-act-f32": settings(32, 256, 4, 16, 256, 4), "up16k512": settings(16, 512, 4, 8, 512, 4),
           "up128w4-down32": settings(128, 128, 4, 32, 256, 4)},
}


def experts(shape: dict, fp8: bool, generator: torch.Generator) -> dict:
    """gate_up [E, 2I, H] and down [E, H, I] (bf16 × 0.02, or FP8 with block scales, 16 experts at a time)."""
    from afd.kernels.fp8_blocks import quantize_block_fp8

    count, hidden, inter = shape["routed"] + shape["shared"], shape["hidden"], shape["inter"]
    parts: dict[str, list] = {}
    for first in range(0, count, 16):
        for name, rows, cols in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
            w = torch.randn(min(16, count - first), rows, cols, device=DEVICE, generator=generator,
                            dtype=torch.bfloat16) * 0.02
            chunks = quantize_block_fp8(w) if fp8 else (w, None)
            parts.setdefault(name, []).append(chunks[0])
            parts.setdefault(f"{name}_scale", []).append(chunks[1])
    return {name: torch.cat(chunks) if chunks[0] is not None else None for name, chunks in parts.items()}


def floor_ms(ids: torch.Tensor, weights: dict, shared: int, copy_bytes_per_s: float) -> float:
    """ms to read the touched experts' weights (and scales) once at the measured copy rate."""
    touched = int(ids.unique().numel()) + shared
    per_expert = sum(w[0].numel() * w.element_size() for w in weights.values() if w is not None)
    return 1e3 * touched * per_expert / copy_bytes_per_s


def measure(name: str, tokens: int, stacks: dict, copy_rate: float, generator: torch.Generator,
            variants: dict | None) -> dict:
    from afd.kernels import moe, moe_small

    shape = MOE_SHAPES[name]
    x = torch.randn(tokens, shape["hidden"], device=DEVICE, generator=generator, dtype=torch.bfloat16)
    weights, ids = torch.rand(tokens, shape["routed"], device=DEVICE, generator=generator).topk(shape["top_k"], -1)
    args = (x, weights.bfloat16(), ids, stacks["gate_up"], stacks["down"], shape["shared"], None,
            stacks["gate_up_scale"], stacks["down_scale"])
    os.environ["AFD_MOE_SMALL_TOKENS"] = "0"
    row = {"shape": name, "tokens": tokens, "floor_ms": floor_ms(ids, stacks, shape["shared"], copy_rate),
           "aligned_ms": time_graph(lambda: moe.experts_triton(*args))}
    reference = moe.experts_triton(*args).float()
    row["small_ms"] = time_graph(lambda: moe_small.experts_small(*args))
    out = moe_small.experts_small(*args).float()
    row["rel_err"] = float((out - reference).norm() / reference.norm())
    if variants:
        row["variants_ms"] = {label: time_graph(lambda cfg=cfg: moe_small.experts_small(*args, settings=cfg))
                              for label, cfg in variants.items()}
    return row


def print_row(row: dict) -> None:
    print(f"{row['shape']:>16} {row['tokens']:>6} {row['floor_ms']:>9.4f} {row['aligned_ms']:>11.4f} "
          f"{row['aligned_ms'] / row['floor_ms']:>8.2f} {row['small_ms']:>9.4f} {row['small_ms'] / row['floor_ms']:>8.2f} "
          f"{row['small_ms'] / row['aligned_ms']:>13.2f} {row['rel_err']:>8.1e}", flush=True)
    if "variants_ms" in row:
        timed = {"default": row["small_ms"], **row["variants_ms"]}
        best = min(timed, key=timed.get)
        listed = ", ".join(f"{label} {ms:.4f}" for label, ms in timed.items())
        print(f"{'':>16} variants ms: {listed}; fastest {best} ({timed[best] / row['floor_ms']:.2f} x floor)",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    parser.add_argument("--tokens", default="1,2,4,8")
    parser.add_argument("--variants", default="", help="token counts at which to time VARIANTS too (e.g. 1)")
    parser.add_argument("--deadline", type=float, default=0.0, help="seconds; 0: none")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    if unknown := set(shapes) - set(SHAPES):
        parser.error(f"unknown shapes {sorted(unknown)}; known: {', '.join(SHAPES)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    variant_tokens = {int(t) for t in args.variants.split(",") if t}
    require_cuda(__file__)
    from afd.kernels.moe_small import MAX_TOKENS

    if max(tokens) > MAX_TOKENS:
        parser.error(f"the small path takes at most {MAX_TOKENS} tokens")
    start = time.monotonic()
    limits = ceilings()
    print(f"copy {limits['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write); {torch.cuda.get_device_name()}")
    print(f"{'shape':>16} {'tokens':>6} {'floor ms':>9} {'aligned ms':>11} {'x floor':>8} {'small ms':>9} "
          f"{'x floor':>8} {'small/aligned':>13} {'rel err':>8}", flush=True)
    rows = []
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.inference_mode():
        for name in shapes:
            if args.deadline and time.monotonic() - start > args.deadline:
                print(f"deadline ({args.deadline:.0f} s) passed: {name} and the shapes after it not measured")
                break
            fp8 = name in FP8_SHAPES
            stacks = experts(MOE_SHAPES[name], fp8, generator)
            for count in tokens:
                if args.deadline and time.monotonic() - start > args.deadline:
                    print(f"deadline ({args.deadline:.0f} s) passed: {name} from {count} tokens on not measured")
                    break
                rows.append(measure(name, count, stacks, limits["copy_bytes_per_s"], generator,
                                    VARIANTS[fp8] if count in variant_tokens else None))
                print_row(rows[-1])
                write_json("moe_small", {"ceilings": limits, "device": torch.cuda.get_device_name(), "rows": rows})
            del stacks
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
