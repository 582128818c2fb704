"""The FP8 MoE layer vs its floor and vs the bf16 layer on the same (dequantized) weights, CUDA-graph replays.

    python3 bench/kernels/moe_layer_fp8.py --shape deepseek-v3     # writes $OUT/moe_layer_fp8-SHAPE.json, prints a table
    python3 bench/kernels/moe_layer_fp8.py --shape qwen3-30b-a3b --tokens 64,1024,4096
    python3 bench/kernels/moe_layer_fp8.py --tokens 1024,4096 --no-bf16 --profile     # + the slowest kernels, µs
    python3 bench/kernels/moe_layer_fp8.py --tokens 8192,16384,32768 --before OLD_FP8_TABLE.json   # + the layer on that table

The layer is the router, the routing (DeepSeek-V3: noaux_tc in the Triton kernel; Qwen3: greedy softmax) and
the routed + shared experts (shared folded in as experts) in FP8: e4m3 weights with 128×128 block scales,
activations quantized per token per 128 columns (`afd.kernels.moe`, `afd.kernels.fp8_gemm`). Weights are random
bf16, quantized by `afd.kernels.fp8_blocks.quantize_block_fp8`; the bf16 layer multiplies the dequantized weights.
`experts ms` is the experts alone on a fixed routing (both layers get the same one, so `rel err` — the FP8
output against the bf16 one, by norm — is the experts' arithmetic only). Floor = max(FP8 bytes of the touched
experts and their scales / the measured copy rate, matmul FLOPs / the measured FP8 rate (cuBLAS, 8192³)).
The operating-point columns (issue 54): achieved FLOP/s (the experts' matmul FLOPs over the time) ÷ the dense rate
measured in the same run — `torch._scaled_mm` for FP8, `torch.mm` for the bf16 experts, both 8192³ — for the layer
and for the experts alone, and the layer's time ÷ its byte floor. `--profile` also sums the kernels by part of the
layer (`kernel_parts`): router GEMM, routing, alignment, activation quantization, the two grouped GEMMs, the slot sum.

DeepSeek-V3's `e_score_correction_bias` is drawn with `--bias-std` (default 0.01). A trained bias balances the experts'
load (that is what it is for), and 0.01 leaves the random router's choices balanced: every expert touched, the
busiest ~2× the mean. Sessions 40-47 drew it at 0.1, which decides most picks by the bias alone (the sigmoid scores of
the best experts saturate near 1): at 4,096 tokens ~70 of the 256 experts go untouched and the busiest gets ~10× the
mean, which lowers the byte floor and is no routing a trained model makes. `--bias-std 0.1` repeats those figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import ceilings, print_kernel_times, require_cuda, time_callable, time_graph, write_json  # noqa: E402
from bench.harness.shapes import MOE_SHAPES  # noqa: E402
from bench.kernels.moe_layer import settings_from  # noqa: E402

from afd.kernels import split_linear  # noqa: E402
from afd.kernels.moe import experts_cuda  # noqa: E402
from afd.kernels.routing import select_greedy, select_noaux_tc  # noqa: E402
from afd.kernels.fp8_blocks import dequantize_block_fp8, quantize_block_fp8  # noqa: E402

TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)


def fp8_rate() -> float:
    """FLOP/s of cuBLAS's FP8 GEMM (per-tensor scales) at 8192³: the FP8 ceiling."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms = time_callable(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 20)
    return 2 * 8192**3 / (ms / 1e3)


# (part of the layer, kernel-name fragments), first match wins; a kernel matching none counts as "other"
PARTS = (("gate_up GEMM", ("_gate_up_kernel",)), ("down GEMM", ("_down_kernel",)), ("slot sum", ("_sum_slots",)),
         ("act quant", ("_quant_kernel",)), ("gather", ("_gather_kernel",)),
         ("align", ("_count_kernel", "_offsets_kernel", "_scatter_kernel", "_align_one", "Memset", "fill")),
         ("routing", ("_select_kernel", "topk", "sigmoid", "softmax")),
         ("router GEMM", ("gemm", "nvjet", "cutlass", "sm90", "_split")))


def kernel_parts(micros: dict[str, float]) -> dict[str, float]:
    """{part of the layer: µs} from the profiler's {kernel name: µs} (`PARTS`)."""
    parts: dict[str, float] = {}
    for name, us in micros.items():
        part = next((part for part, keys in PARTS if any(key.lower() in name.lower() for key in keys)), "other")
        parts[part] = parts.get(part, 0.0) + us
    return parts


def quantized_experts(shape: dict, seed: int = 0):
    """(gate_up, gate_up_scale, down, down_scale) in FP8 for routed + shared experts, quantized a few at a time."""
    experts, hidden, inter = shape["routed"] + shape["shared"], shape["hidden"], shape["inter"]
    generator = torch.Generator(device="cuda").manual_seed(seed)
    parts = {"gate_up": [], "gate_up_scale": [], "down": [], "down_scale": []}
    for first in range(0, experts, 16):
        count = min(16, experts - first)
        for name, rows, cols in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
            w = torch.randn(count, rows, cols, device="cuda", generator=generator, dtype=torch.bfloat16) * 0.02
            quant, scale = quantize_block_fp8(w)
            parts[name].append(quant)
            parts[f"{name}_scale"].append(scale)
    return {name: torch.cat(chunks) for name, chunks in parts.items()}


def dequantized(quant: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bf16 weights an FP8 stack stands for, dequantized 16 experts at a time (float32 copies of all: too big)."""
    return torch.cat([dequantize_block_fp8(quant[i:i + 16], scale[i:i + 16], torch.bfloat16)
                      for i in range(0, quant.shape[0], 16)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="deepseek-v3", choices=sorted(MOE_SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 layer (its time and the error)")
    parser.add_argument("--profile", action="store_true", help="print the layer's slowest kernels at each count")
    parser.add_argument("--before", help="an FP8 table file (e.g. the one before a re-tune) to time the layer on too")
    parser.add_argument("--bias-std", type=float, default=0.01,
                        help="spread of DeepSeek-V3's random e_score_correction_bias (0.1: sessions 40-47's, skewed)")
    args = parser.parse_args()
    require_cuda(__file__)
    shape = MOE_SHAPES[args.shape]
    limits = {**ceilings(), "fp8_flops": fp8_rate()}
    routed, shared, top_k, hidden, inter = (shape[key] for key in ("routed", "shared", "top_k", "hidden", "inter"))
    fp8 = quantized_experts(shape)
    bf16 = None if args.no_bf16 else {name: dequantized(fp8[name], fp8[f"{name}_scale"])
                                      for name in ("gate_up", "down")}
    generator = torch.Generator(device="cuda").manual_seed(1)
    router = torch.randn(routed, hidden, device="cuda", generator=generator) * 0.02
    parts = split_linear.bf16_parts(router) if shape["fp32_logits"] else None  # as the model's float32 gate runs
    if not shape["fp32_logits"]:
        router = router.bfloat16()
    bias = torch.randn(routed, device="cuda", generator=generator) * args.bias_std
    grouped = "n_group" in shape

    def route(x):
        logits = split_linear.linear_fp32(x, parts) if parts is not None else torch.nn.functional.linear(x, router)
        if grouped:
            return select_noaux_tc(logits, bias, top_k, shape["n_group"], shape["topk_group"], True,
                                   shape["routed_scaling_factor"], x.dtype)
        return select_greedy(logits, top_k, shape["norm_topk_prob"], True, 1.0, x.dtype)

    scale_bytes = 4 * (fp8["gate_up_scale"][0].numel() + fp8["down_scale"][0].numel())
    rows = []
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", generator=generator)
            weights, ids = route(x)
            loads = torch.bincount(ids.flatten(), minlength=routed)
            touched = int((loads > 0).sum()) + shared
            weight_bytes = touched * (3 * hidden * inter + scale_bytes) + router.numel() * router.element_size()
            flops = 2 * tokens * (top_k + shared) * 3 * hidden * inter
            byte_floor = 1e3 * weight_bytes / limits["copy_bytes_per_s"]
            floor = max(byte_floor, 1e3 * flops / limits["fp8_flops"])

            def layer():
                w, i = route(x)
                return experts_cuda(x, w, i, fp8["gate_up"], fp8["down"], shared, None, fp8["gate_up_scale"],
                                    fp8["down_scale"])

            row = {"tokens": tokens, "touched_experts": touched, "busiest_expert_rows": int(loads.max()),
                   "flops": flops, "floor_ms": floor, "byte_floor_ms": byte_floor, "fp8_ms": time_graph(layer),
                   "fp8_experts_ms": time_graph(lambda: experts_cuda(
                       x, weights, ids, fp8["gate_up"], fp8["down"], shared, None, fp8["gate_up_scale"],
                       fp8["down_scale"]))}
            if bf16 is not None:
                row["bf16_experts_ms"] = time_graph(lambda: experts_cuda(x, weights, ids, bf16["gate_up"],
                                                                         bf16["down"], shared))
                out_fp8 = experts_cuda(x, weights, ids, fp8["gate_up"], fp8["down"], shared, None,
                                       fp8["gate_up_scale"], fp8["down_scale"]).float()
                out_bf16 = experts_cuda(x, weights, ids, bf16["gate_up"], bf16["down"], shared).float()
                row["rel_err_vs_bf16"] = float((out_fp8 - out_bf16).norm() / out_bf16.norm())
            if args.before:
                with settings_from(args.before):
                    row["before_fp8_ms"] = time_graph(layer)
            add_rates(row, limits)
            if args.profile:
                row["kernel_us"] = print_kernel_times(layer, f"{tokens} tokens")
                row["part_us"] = kernel_parts(row["kernel_us"])
                total = sum(row["part_us"].values()) or 1.0
                print("      by part: " + ", ".join(f"{part} {us:.0f} µs ({100 * us / total:.0f} %)" for part, us in
                                                  sorted(row["part_us"].items(), key=lambda item: -item[1])))
            rows.append(row)
            print(f"{tokens:>5} tokens ({touched} experts touched, the busiest {int(loads.max())} rows): floor "
                  f"{floor:.3f} ms, FP8 layer {row['fp8_ms']:.3f} ms "
                  f"({row['fp8_ms'] / floor:.2f}x floor), FP8 experts {row['fp8_experts_ms']:.3f} ms"
                  + (f", bf16 experts {row['bf16_experts_ms']:.3f} ms, rel err {row['rel_err_vs_bf16']:.2e}"
                     if bf16 is not None else ""), flush=True)
    write_json(f"moe_layer_fp8-{args.shape}", {"shape": args.shape, "bias_std": args.bias_std, "ceilings": limits,
                                               "rows": rows})
    print(f"copy {limits['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), FP8 matmul "
          f"{limits['fp8_flops'] / 1e12:.0f} TFLOP/s, bf16 {limits['bf16_flops'] / 1e12:.0f} TFLOP/s")
    print(f"{'tokens':>6} {'floor ms':>9} {'fp8 ms':>8} {'x floor':>8} {'experts':>8} {'bf16 exp':>9} {'rel err':>8}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['floor_ms']:>9.3f} {r['fp8_ms']:>8.3f} {r['fp8_ms'] / r['floor_ms']:>8.2f} "
              f"{r['fp8_experts_ms']:>8.3f} {r.get('bf16_experts_ms', float('nan')):>9.3f} "
              f"{r.get('rel_err_vs_bf16', float('nan')):>8.1e}")
    print_rates(args.shape, rows, limits)


def add_rates(row: dict, limits: dict) -> None:
    """The row's achieved TFLOP/s and their ratios to the dense rates (`limits`), and time ÷ byte floor."""
    for name, ms, dense in (("fp8_layer", row["fp8_ms"], limits["fp8_flops"]),
                            ("fp8_experts", row["fp8_experts_ms"], limits["fp8_flops"]),
                            ("bf16_experts", row.get("bf16_experts_ms"), limits["bf16_flops"]),
                            ("before_fp8_layer", row.get("before_fp8_ms"), limits["fp8_flops"])):
        if ms:
            row[f"{name}_tflops"] = row["flops"] / ms / 1e9
            row[f"{name}_of_dense"] = row["flops"] / (ms / 1e3) / dense
    row["fp8_over_byte_floor"] = row["fp8_ms"] / row["byte_floor_ms"]


def print_rates(shape: str, rows: list[dict], limits: dict) -> None:
    """The operating-point table: achieved TFLOP/s ÷ the dense rates measured in this run, time ÷ byte floor."""
    print(f"{shape}: achieved TFLOP/s ÷ dense (FP8 {limits['fp8_flops'] / 1e12:.0f}, bf16 "
          f"{limits['bf16_flops'] / 1e12:.0f} TFLOP/s measured here); x bytes = layer time ÷ byte floor")
    print(f"{'tokens':>6} {'TFLOP':>7} {'fp8 layer':>10} {'÷ dense':>8} {'fp8 exp':>8} {'÷ dense':>8} "
          f"{'bf16 exp':>9} {'÷ dense':>8} {'x bytes':>8} {'before':>8} {'÷ dense':>8}")
    nan = float("nan")
    for r in rows:
        print(f"{r['tokens']:>6} {r['flops'] / 1e12:>7.2f} {r['fp8_layer_tflops']:>10.0f} "
              f"{r['fp8_layer_of_dense']:>8.2f} "
              f"{r['fp8_experts_tflops']:>8.0f} {r['fp8_experts_of_dense']:>8.2f} "
              f"{r.get('bf16_experts_tflops', nan):>9.0f} {r.get('bf16_experts_of_dense', nan):>8.2f} "
              f"{r['fp8_over_byte_floor']:>8.2f} {r.get('before_fp8_layer_tflops', nan):>8.0f} "
              f"{r.get('before_fp8_layer_of_dense', nan):>8.2f}")


if __name__ == "__main__":
    main()
