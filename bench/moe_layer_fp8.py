"""The FP8 MoE layer vs its floor and vs the bf16 layer on the same (dequantized) weights, CUDA-graph replays.

    python3 bench/moe_layer_fp8.py --shape deepseek-v3     # writes $OUT/moe_layer_fp8-SHAPE.json, prints a table
    python3 bench/moe_layer_fp8.py --shape qwen3-30b-a3b --tokens 64,1024,4096
    python3 bench/moe_layer_fp8.py --shape deepseek-v3 --tokens 1024,4096 --variants all --no-bf16   # + variants
    python3 bench/moe_layer_fp8.py --tokens 1024,4096 --no-bf16 --profile     # + the slowest kernels, µs

The layer is the router, the routing (DeepSeek-V3: noaux_tc in the Triton kernel; Qwen3: greedy softmax) and
the routed + shared experts (shared folded in as experts) in FP8: e4m3 weights with 128×128 block scales,
activations quantized per token per 128 columns (`afd.kernels.moe`, `afd.kernels.fp8_gemm`). Weights are random
bf16, quantized by `afd.kernels.fp8_blocks.quantize_block_fp8`; the bf16 layer multiplies the dequantized weights.
`experts ms` is the experts alone on a fixed routing (both layers get the same one, so `rel err` — the FP8
output against the bf16 one, by norm — is the experts' arithmetic only). Floor = max(FP8 bytes of the touched
experts and their scales / the measured copy rate, matmul FLOPs / the measured FP8 rate (cuBLAS, 8192³)).

With `--variants` each token count also runs the layer with other kernel settings laid over the table entry's
(`VARIANTS`: the Gluon kernels of `afd.kernels.moe_fp8_gluon`, RESCALE's one accumulator and the 128-row tiles it
fits) and prints each one's layer time, ÷ floor, ÷ the table's layer, and its largest difference from the table's
output.
"""

from __future__ import annotations

import argparse

import torch
from common import MOE_SHAPES, ceilings, print_kernel_times, require_cuda, time_callable, time_graph, write_json

from afd.kernels import moe, split_linear
from afd.kernels.moe import experts_cuda
from afd.kernels.routing import select_greedy, select_noaux_tc
from afd.kernels.fp8_blocks import dequantize_block_fp8, quantize_block_fp8

TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)
GLUON_GATE_UP = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "TMA": True, "GATHER": True, "ONE_DOT": False,
                 "GLUON": True, "num_warps": 8, "num_stages": 4}
GLUON_DOWN = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "TMA": True, "GLUON": True, "num_warps": 4,
              "num_stages": 4}
TALL_GATE_UP = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "TMA": True, "GATHER": True, "ONE_DOT": False,
                "RESCALE": True, "num_warps": 8, "num_stages": 3}
TALL_DOWN = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "TMA": True, "RESCALE": True, "num_warps": 8,
             "num_stages": 3}
VARIANTS = {  # name → (layout rows, settings laid over the table's gate_up, over its down; None: the table's own)
    "gluon": (64, GLUON_GATE_UP, GLUON_DOWN),
    "gluon-down": (64, None, GLUON_DOWN),
    "rescale-64": (64, {"RESCALE": True}, {"RESCALE": True}),
    "rescale-128": (128, TALL_GATE_UP, TALL_DOWN),
    "rescale-128-s4": (128, {**TALL_GATE_UP, "num_stages": 4}, {**TALL_DOWN, "num_stages": 4}),
    "rescale-128-one-dot": (128, {**TALL_GATE_UP, "ONE_DOT": True}, TALL_DOWN),
    "rescale-128-gate_up": (128, TALL_GATE_UP, None),
    "rescale-128-down": (128, None, TALL_DOWN),
}


def variant_entry(entry: dict, layout_m: int, gate_up: dict | None, down: dict | None) -> dict:
    """The table entry in a layout of `layout_m` rows with `gate_up` / `down` settings laid over its kernels (each
    kernel's own tile no taller than the layout's)."""
    def over(kernel: dict, settings: dict | None) -> dict:
        return {**kernel, "BLOCK_M": min(kernel.get("BLOCK_M", entry["BLOCK_M"]), layout_m), **(settings or {})}
    return {"BLOCK_M": layout_m, "gate_up": over(entry["gate_up"], gate_up), "down": over(entry["down"], down)}


def fp8_rate() -> float:
    """FLOP/s of cuBLAS's FP8 GEMM (per-tensor scales) at 8192³: the FP8 ceiling."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms = time_callable(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 20)
    return 2 * 8192**3 / (ms / 1e3)


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


def device_table_entry(x, fp8: dict, tokens: int) -> dict:
    """The table entry the FP8 experts take at `tokens` on this GPU."""
    experts, hidden, inter = fp8["down"].shape
    return moe.pick_config(moe.device_table(x.device, experts, hidden, inter, True), tokens)


def variant_rows(layer, entry: dict, floor: float, table_ms: float, names: list[str]) -> dict:
    """Each variant's layer time (the routing and every other kernel unchanged) and its largest difference from
    the table's output; printed as it goes."""
    reference = layer().float()
    table = moe.device_table
    rows = {}
    try:
        for name in names:
            variant = variant_entry(entry, *VARIANTS[name])
            moe.device_table = lambda *args, variant=variant: {1: variant}
            try:
                ms = time_graph(layer)
                diff = float((layer().float() - reference).abs().max() / reference.abs().max())
            except Exception as err:  # noqa: BLE001 - a variant this GPU cannot run is reported, not fatal
                print(f"      {name}: failed ({type(err).__name__}: {str(err)[:200]})", flush=True)
                continue
            rows[name] = {"ms": ms, "max_diff_rel": diff, "entry": variant}
            print(f"      {name}: {ms:.3f} ms ({ms / floor:.2f}x floor, {ms / table_ms:.3f}x the table's), "
                  f"max |diff| / max |out| {diff:.1e}", flush=True)
    finally:
        moe.device_table = table
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="deepseek-v3", choices=sorted(MOE_SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 layer (its time and the error)")
    parser.add_argument("--profile", action="store_true", help="print the layer's slowest kernels at each count")
    parser.add_argument("--variants", default="", help="also the layer with these kernel variants (VARIANTS: "
                        f"{','.join(VARIANTS)}), or 'all'")
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
    bias = torch.randn(routed, device="cuda", generator=generator) * 0.1
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
            touched = int(ids.unique().numel()) + shared
            weight_bytes = touched * (3 * hidden * inter + scale_bytes) + router.numel() * router.element_size()
            flops = 2 * tokens * (top_k + shared) * 3 * hidden * inter
            floor = 1e3 * max(weight_bytes / limits["copy_bytes_per_s"], flops / limits["fp8_flops"])

            def layer():
                w, i = route(x)
                return experts_cuda(x, w, i, fp8["gate_up"], fp8["down"], shared, None, fp8["gate_up_scale"],
                                    fp8["down_scale"])

            row = {"tokens": tokens, "touched_experts": touched, "floor_ms": floor, "fp8_ms": time_graph(layer),
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
            if args.profile:
                micros = print_kernel_times(layer, f"{tokens} tokens, the table's kernels")
                row["kernel_us"] = micros
            if args.variants:
                names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
                row["variants"] = variant_rows(layer, device_table_entry(x, fp8, tokens), floor, row["fp8_ms"], names)
            rows.append(row)
            print(f"{tokens:>5} tokens: floor {floor:.3f} ms, FP8 layer {row['fp8_ms']:.3f} ms "
                  f"({row['fp8_ms'] / floor:.2f}x floor), FP8 experts {row['fp8_experts_ms']:.3f} ms"
                  + (f", bf16 experts {row['bf16_experts_ms']:.3f} ms, rel err {row['rel_err_vs_bf16']:.2e}"
                     if bf16 is not None else ""), flush=True)
    write_json(f"moe_layer_fp8-{args.shape}", {"shape": args.shape, "ceilings": limits, "rows": rows})
    print(f"copy {limits['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), FP8 matmul "
          f"{limits['fp8_flops'] / 1e12:.0f} TFLOP/s, bf16 {limits['bf16_flops'] / 1e12:.0f} TFLOP/s")
    print(f"{'tokens':>6} {'floor ms':>9} {'fp8 ms':>8} {'x floor':>8} {'experts':>8} {'bf16 exp':>9} {'rel err':>8}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['floor_ms']:>9.3f} {r['fp8_ms']:>8.3f} {r['fp8_ms'] / r['floor_ms']:>8.2f} "
              f"{r['fp8_experts_ms']:>8.3f} {r.get('bf16_experts_ms', float('nan')):>9.3f} "
              f"{r.get('rel_err_vs_bf16', float('nan')):>8.1e}")


if __name__ == "__main__":
    main()
