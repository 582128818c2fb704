"""(a) MoE layer time vs its floor at a sample model's shapes, per kernel, CUDA-graph replays.

    python3 bench/kernels/moe_layer.py        # prints a table, writes $OUT/moe_layer.json (or moe_layer-SHAPE.json)
    python3 bench/kernels/moe_layer.py --before OLD_TABLE.json   # also the Triton kernel on another tuned table
    python3 bench/kernels/moe_layer.py --shape qwen3-30b-a3b --tokens 1024,4096 --profile   # + the slowest kernels, µs

The layer is router + top-k routing + routed experts + shared experts (folded in as experts),
bf16: by default DeepSeek-V2-Lite's (top-6 of 64, 2 shared, hidden 2048, width 1408, fp32 router), or
Qwen3-30B-A3B's (top-8 of 128, normalized, no shared, hidden 2048, width 768, bf16 router). `router ms`
is the router and top-k routing alone. Floor = max(bytes
of the touched expert weights / measured copy bandwidth, matmul FLOPs / measured bf16 rate). `÷ bf16`: the
experts' matmul FLOPs over the Triton layer's time ÷ the bf16 rate measured in the same run (`torch.mm`, 8192³).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import ceilings, print_kernel_times, require_cuda, time_graph, write_json  # noqa: E402
from bench.harness.shapes import MOE_SHAPES  # noqa: E402

from afd.models.moe_prep import fuse_shared_experts  # noqa: E402
from afd.models.layers import MoE, Routing  # noqa: E402

TOKENS = (1, 16, 64, 256, 1024, 4096)


def build_layer(shape: dict) -> MoE:
    hidden, width = shape["hidden"], shape["inter"]
    routing = Routing(top_k=shape["top_k"], num_experts=shape["routed"], norm_topk_prob=shape["norm_topk_prob"])
    layer = MoE(hidden, routing, width, width * shape["shared"], fp32_logits=shape["fp32_logits"]).cuda()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.02)
    if shape["fp32_logits"]:
        layer.gate.float()
        layer.gate.split_weight()  # as afd.models.loader.finish_share does for bf16 on a GPU
    else:
        layer.gate.bfloat16()
    layer.experts.bfloat16()
    if layer.shared_experts is not None:
        layer.shared_experts.bfloat16()
    fuse_shared_experts(layer)
    return layer


def floor_ms(layer: MoE, x: torch.Tensor, limits: dict) -> tuple[float, float]:
    """(floor ms, the experts' matmul FLOPs)."""
    weights, ids = layer.routing.select(layer.gate(x), x.dtype)
    touched = int(ids.unique().numel()) + layer.experts.num_shared
    hidden, width = layer.experts.down.shape[1], layer.experts.down.shape[2]
    weight_bytes = touched * 3 * hidden * width * 2 + layer.gate.weight.numel() * layer.gate.weight.element_size()
    flops = 2 * x.shape[0] * (ids.shape[1] + layer.experts.num_shared) * 3 * hidden * width
    return 1e3 * max(weight_bytes / limits["copy_bytes_per_s"], flops / limits["bf16_flops"]), flops


@contextlib.contextmanager
def settings_from(path: str):
    """Inside, every Triton MoE call takes its kernel settings from the tuned table file `path`."""
    from afd.kernels import moe

    table = {int(tokens): cfg for tokens, cfg in json.loads(Path(path).read_text())["configs"].items()}
    tuned = moe.device_table
    moe.device_table = lambda *args: table
    try:
        yield
    finally:
        moe.device_table = tuned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a tuned table file (e.g. the one before a re-tune) to time Triton on as well")
    parser.add_argument("--shape", default="deepseek-v2-lite", choices=sorted(MOE_SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--profile", action="store_true", help="print the Triton layer's slowest kernels per count")
    args = parser.parse_args()
    require_cuda(__file__)
    limits = ceilings()
    shape = MOE_SHAPES[args.shape]
    layer = build_layer(shape)
    rows = []
    with torch.inference_mode():
        for tokens in (int(count) for count in args.tokens.split(",")):
            x = torch.randn(tokens, shape["hidden"], dtype=torch.bfloat16, device="cuda")
            floor, flops = floor_ms(layer, x, limits)
            row = {"tokens": tokens, "floor_ms": floor, "flops": flops,
                   "router_ms": time_graph(lambda: layer.routing.select(layer.gate(x), x.dtype))}
            outputs = {}
            for kernel in ("triton", "grouped"):
                os.environ["AFD_MOE_KERNEL"] = kernel
                row[f"{kernel}_ms"] = time_graph(lambda: layer(x))
                outputs[kernel] = layer(x).float()
            if args.profile:
                os.environ["AFD_MOE_KERNEL"] = "triton"
                row["triton_kernel_us"] = print_kernel_times(lambda: layer(x), f"{tokens} tokens, Triton")
            if args.before:
                os.environ["AFD_MOE_KERNEL"] = "triton"
                with settings_from(args.before):
                    row["before_ms"] = time_graph(lambda: layer(x))
            row["triton_of_bf16_rate"] = flops / (row["triton_ms"] / 1e3) / limits["bf16_flops"]
            row["triton_vs_grouped_rel_err"] = float((outputs["triton"] - outputs["grouped"]).norm() / outputs["grouped"].norm())
            rows.append(row)
    name = "moe_layer" if args.shape == "deepseek-v2-lite" else f"moe_layer-{args.shape}"
    write_json(name, {"shape": args.shape, "ceilings": limits, "before_table": args.before, "rows": rows})
    print(f"copy {limits['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), bf16 matmul {limits['bf16_flops'] / 1e12:.0f} TFLOP/s")
    before = f" {'before ms':>10} {'x floor':>8} {'now/before':>10}" if args.before else ""
    print(f"{'tokens':>6} {'floor ms':>9} {'router ms':>10} {'triton ms':>10} {'x floor':>8} {'grouped ms':>11} "
          f"{'x floor':>8} {'rel err':>8} {'÷ bf16':>7}{before}")
    for r in rows:
        before = (f" {r['before_ms']:>10.3f} {r['before_ms'] / r['floor_ms']:>8.2f} {r['triton_ms'] / r['before_ms']:>10.2f}"
                  if args.before else "")
        print(f"{r['tokens']:>6} {r['floor_ms']:>9.3f} {r['router_ms']:>10.3f} {r['triton_ms']:>10.3f} {r['triton_ms'] / r['floor_ms']:>8.2f} "
              f"{r['grouped_ms']:>11.3f} {r['grouped_ms'] / r['floor_ms']:>8.2f} {r['triton_vs_grouped_rel_err']:>8.1e} "
              f"{r['triton_of_bf16_rate']:>7.2f}{before}")


if __name__ == "__main__":
    main()
