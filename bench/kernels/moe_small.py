"""The small-token MoE path (`afd.kernels.moe_small`) vs the aligned Triton path at a few tokens, CUDA-graph replays.

    python3 bench/kernels/moe_small.py          # 3 shapes × T = 1, 2, 4, 8: a table; writes $OUT/moe_small.json
    python3 bench/kernels/moe_small.py --variants 1,2,4,8 --deadline 80   # + the settings sweep (~60-90 s on an H100/H200)

Shapes (bench/harness/shapes.py's MOE_SHAPES): deepseek-v2-lite and qwen3-30b-a3b in bf16, deepseek-v3 in FP8 (e4m3
with 128×128 block scales, `quantize_block_fp8` of random weights). The experts alone (gate_up and down stacks,
shared experts folded in as the last ones) on a random greedy top-k routing. `aligned ms`: `moe.experts_triton`
with `AFD_MOE_SMALL_TOKENS=0` (FP8: the tokens' quantization, alignment, two GEMMs, slot sum, with the tuned
table where one ships); `small ms`: `moe_small.experts_small` with its default settings (`moe_small.SETTINGS`).
Floor = bytes of the expert weights touched (distinct routed experts + shared, FP8 scales included) / the measured
copy rate (bytes read + written per second, as moe_layer.py's floor). `rel err`: small vs aligned, by norm.

`--variants T,..`: at those token counts each kernel's settings in `VARIANTS` (labels `moe_small.parse_label`
reads: n16k256w4s3 = BLOCK_N 16, BLOCK_K 256, 4 warps, 3 stages) are timed with the other kernel at its default,
then the fastest of each together: `best ms` and its labels (gate_up/down); a variant whose result strays from the
aligned one (rel err) is never the best. At the end, `suggested SETTINGS`: per dtype, each kernel's label with
the least geometric mean over that dtype's swept shapes and token counts of its time / that row's fastest — one
setting for every token count, a line to paste into moe_small.py. `--deadline S` starts no shape or token count after S seconds (what is done is
printed and written). Without a CUDA GPU it says so and exits 1.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import ceilings, require_cuda, time_graph, write_json  # noqa: E402
from bench.harness.shapes import MOE_SHAPES  # noqa: E402

DEVICE = "cuda"
SHAPES = ("deepseek-v2-lite", "qwen3-30b-a3b", "deepseek-v3")
FP8_SHAPES = {"deepseek-v3"}


VARIANTS = {  # FP8 → kernel → labels timed with the other kernel at its default (FP8: BLOCK_K 128, BLOCK_N ≤ 128)
    False: {"gate_up": ["n16k256w4s3", "n16k256w4s1", "n16k128w4s4", "n8k256w4s4", "n32k128w4s3", "n16k256w8s4",
                        "n8k512w4s3", "n16k128w4s6"],
            "down": ["n4k128w4s4", "n4k128w4s1", "n2k256w4s4", "n4k256w4s3", "n8k128w4s3", "n8k128w8s4",
                     "n2k128w4s6", "n16k64w4s4"]},
    True: {"gate_up": ["n32k128w4s4", "n32k128w4s1", "n16k128w4s4", "n16k128w4s6", "n64k128w8s3", "n128k128w8s3",
                       "n32k128w8s5"],
           "down": ["n4k128w4s4", "n4k128w4s1", "n2k128w4s4", "n2k128w4s6", "n8k128w8s4", "n4k128w8s6",
                    "n1k128w4s6"]},
}
TOLERANCE = {False: 2e-3, True: 1e-2}  # rel err vs aligned that a variant must keep (tests/runtime/test_moe_small.py's)


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
            sweep: bool) -> dict:
    from afd.kernels import moe, moe_small

    shape = MOE_SHAPES[name]
    fp8 = name in FP8_SHAPES
    x = torch.randn(tokens, shape["hidden"], device=DEVICE, generator=generator, dtype=torch.bfloat16)
    weights, ids = torch.rand(tokens, shape["routed"], device=DEVICE, generator=generator).topk(shape["top_k"], -1)
    args = (x, weights.bfloat16(), ids, stacks["gate_up"], stacks["down"], shape["shared"], None,
            stacks["gate_up_scale"], stacks["down_scale"])
    os.environ["AFD_MOE_SMALL_TOKENS"] = "0"
    row = {"shape": name, "tokens": tokens, "floor_ms": floor_ms(ids, stacks, shape["shared"], copy_rate),
           "aligned_ms": time_graph(lambda: moe.experts_triton(*args))}
    reference = moe.experts_triton(*args).float()

    def run(cfg: dict | None) -> tuple[float, float]:
        """(ms, rel err vs aligned) of the small path at `cfg` (None: its defaults)."""
        out = moe_small.experts_small(*args, settings=cfg).float()
        return (time_graph(lambda: moe_small.experts_small(*args, settings=cfg)),
                float((out - reference).norm() / reference.norm()))

    row["small_ms"], row["rel_err"] = run(None)
    default = moe_small.SETTINGS[fp8]
    best = {kernel: moe_small.label(cfg) for kernel, cfg in default.items()}
    row["best"] = {**best, "ms": row["small_ms"], "rel_err": row["rel_err"]}
    if sweep:
        row["variants_ms"] = {}
        for kernel, labels in VARIANTS[fp8].items():
            timed = {}
            for label in labels:
                ms, err = run({**default, kernel: moe_small.parse_label(label)})
                timed[label] = ms if err < TOLERANCE[fp8] else float("inf")  # JSON: Infinity
            row["variants_ms"][kernel] = timed
            best[kernel] = min(timed, key=timed.get)
        ms, err = run(moe_small.parse_settings(best["gate_up"], best["down"]))
        row["best"] = {**best, "ms": ms, "rel_err": err}
    return row


def print_row(row: dict) -> None:
    best, floor = row["best"], row["floor_ms"]
    print(f"{row['shape']:>16} {row['tokens']:>6} {floor:>9.4f} {row['aligned_ms']:>11.4f} "
          f"{row['aligned_ms'] / floor:>8.2f} {row['small_ms']:>9.4f} {row['small_ms'] / floor:>8.2f} "
          f"{best['ms']:>9.4f} {best['ms'] / floor:>8.2f} {best['ms'] / row['aligned_ms']:>12.2f} "
          f"{best['rel_err']:>8.1e}  {best['gate_up']}/{best['down']}", flush=True)
    for kernel, timed in row.get("variants_ms", {}).items():
        listed = ", ".join(f"{label} {ms:.4f}" for label, ms in timed.items())
        print(f"{'':>16} {kernel} ms: {listed}", flush=True)


def suggest(rows: list) -> dict:
    """FP8 → kernel → the label with the least geometric mean, over that dtype's swept shapes and token counts, of its
    time / that row's fastest (of the labels timed in every such row): one setting for every token count, as
    `moe_small.SETTINGS` keeps (a token's result then does not depend on how many tokens share its step)."""
    table: dict = {}
    for fp8 in (False, True):
        swept = [row for row in rows if (row["shape"] in FP8_SHAPES) == fp8 and "variants_ms" in row]
        if not swept:
            continue
        pair = {}
        for kernel in ("gate_up", "down"):
            common = set.intersection(*(set(row["variants_ms"][kernel]) for row in swept))
            score = {label: math.prod(row["variants_ms"][kernel][label] / min(row["variants_ms"][kernel].values())
                                      for row in swept) for label in common}
            score = {label: value for label, value in score.items() if math.isfinite(value)}
            if score:  # else every label strayed somewhere: no suggestion
                pair[kernel] = min(sorted(score), key=score.get)
        if len(pair) == 2:
            table[fp8] = pair
    return table


def print_suggestion(table: dict) -> None:
    entries = [f'{fp8}: parse_settings("{pair["gate_up"]}", "{pair["down"]}")' for fp8, pair in table.items()]
    if entries:
        print("suggested SETTINGS = {" + ",\n            ".join(entries) + "}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    parser.add_argument("--tokens", default="1,2,4,8")
    parser.add_argument("--variants", default="", help="token counts at which to sweep VARIANTS (e.g. 1,2,4,8)")
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
          f"{'x floor':>8} {'best ms':>9} {'x floor':>8} {'best/aligned':>12} {'rel err':>8}  settings (gate_up/down)",
          flush=True)
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
                                    count in variant_tokens))
                print_row(rows[-1])
                write_json("moe_small", {"ceilings": limits, "device": torch.cuda.get_device_name(), "rows": rows})
            del stacks
            torch.cuda.empty_cache()
    print_suggestion(suggest(rows))


if __name__ == "__main__":
    sys.exit(main())
