"""How far two expert-parallel shards' sum is from the monolith's FP8 MoE layer, bit for bit (issue 32, session 41).

One FP8 MoE layer (routed experts, top-k, one shared expert of the routed width, 128×128 block scales) computed
as the monolith computes it (the shared expert folded into the fused kernels) and as two shards do (half the
routed experts and half the shared expert's columns each, float32 partials added, rounded once), the shard's
shared half computed two ways: `SharedStack` (the fused kernels; this session) and the separate FP8 MLP of before
(gate, up, SiLU·up rounded to the activations' dtype, down's input quantized from them). Printed per token count:
elements that differ from the monolith and the largest difference in units of the activations' dtype at
max(|output|, |shared output|). Also: how many elements the monolith itself changed by keeping the shared row
in float32 (before: rounded first).

    python3 bench/kernels/shared_slice_rounding.py                       # a GPU: bf16
    TRITON_INTERPRET=1 python3 bench/kernels/shared_slice_rounding.py    # no GPU: Triton's interpreter, float16
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from afd.kernels import moe  # noqa: E402
from afd.kernels.fp8_blocks import quantize_block_fp8  # noqa: E402
from afd.kernels.fp8_gemm import fp8_linear  # noqa: E402
from afd.models.layers import Experts  # noqa: E402
from afd.models.shared_stack import SharedStack  # noqa: E402


def layer(tokens: int, hidden: int, inter: int, routed: int, top_k: int, device: str, dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    gate_up, gate_up_scale = quantize_block_fp8(torch.randn(routed + 1, 2 * inter, hidden, generator=generator) * 0.05)
    down, down_scale = quantize_block_fp8(torch.randn(routed + 1, hidden, inter, generator=generator) * 0.05)
    x = (torch.randn(tokens, hidden, generator=generator) * 2).to(dtype)
    weights, ids = torch.rand(tokens, routed, generator=generator).topk(top_k, dim=-1)
    return [t.to(device) for t in (x, weights.to(dtype), ids, gate_up, gate_up_scale, down, down_scale)]


def shard_sums(x, weights, ids, gate_up, gate_up_scale, down, down_scale, routed: int):
    """(shards with `SharedStack`, shards with the separate MLP): float32 sums of two shards' partials."""
    inter = down.shape[2]
    half, per_shard = inter // 2, routed // 2
    stacked, separate = 0, 0
    for shard in range(2):
        experts = slice(shard * per_shard, (shard + 1) * per_shard)
        gate_cols = slice(shard * half, (shard + 1) * half)
        up_cols = slice(inter + shard * half, inter + (shard + 1) * half)
        gate_blocks, up_blocks = (slice(c.start // 128, c.stop // 128) for c in (gate_cols, up_cols))
        local = Experts(per_shard, x.shape[1], inter, first=shard * per_shard)
        partial = moe.experts_cuda(x, *local.localize(weights, ids), gate_up[experts], down[experts], 0,
                                   torch.float32, gate_up_scale[experts], down_scale[experts])
        gate_w, up_w, down_w = gate_up[routed, gate_cols], gate_up[routed, up_cols], down[routed, :, gate_cols]
        gate_s, up_s = gate_up_scale[routed, gate_blocks], gate_up_scale[routed, up_blocks]
        down_s = down_scale[routed, :, gate_blocks]
        stack = SharedStack(torch.cat((gate_w, up_w))[None], down_w[None].contiguous(),
                            torch.cat((gate_s, up_s))[None], down_s[None].contiguous())
        stacked = stacked + partial + stack.kernels(x)
        gate = fp8_linear(x, gate_w.contiguous(), gate_s.contiguous())
        up = fp8_linear(x, up_w.contiguous(), up_s.contiguous())
        separate = separate + partial + fp8_linear(F.silu(gate) * up, down_w.contiguous(), down_s.contiguous())
    return stacked, separate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,6,37")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=256)
    parser.add_argument("--routed", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interpreted:
        sys.exit("needs a CUDA GPU or TRITON_INTERPRET=1")
    device, dtype = ("cpu", torch.float16) if interpreted else ("cuda", torch.bfloat16)
    os.environ["AFD_MOE_KERNEL"] = "triton"
    os.environ.setdefault("AFD_FP8_GEMM", "triton" if interpreted else "auto")
    if interpreted:  # no GPU name to look a table up by
        moe.device_table = lambda *unused: {1: moe.FP8_DEFAULT_CONFIGS[1]}
    print(f"{device} {dtype}, hidden {args.hidden}, width {args.inter}, {args.routed} routed, top-{args.top_k}, "
          "1 shared")
    print("tokens | elements | stack: differ, max ulps | separate MLP: differ, max ulps | monolith before: differ")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x, weights, ids, gate_up, gate_up_scale, down, down_scale = layer(
            tokens, args.hidden, args.inter, args.routed, args.top_k, device, dtype, seed=tokens)
        monolith = moe.experts_cuda(x, weights, ids, gate_up, down, 1, None, gate_up_scale, down_scale)
        shared = SharedStack(gate_up[args.routed:], down[args.routed:], gate_up_scale[args.routed:],
                             down_scale[args.routed:]).kernels(x)
        routed_sum = moe.experts_cuda(x, weights, ids, gate_up[:args.routed], down[:args.routed], 0, torch.float32,
                                      gate_up_scale[:args.routed], down_scale[:args.routed])
        before = (routed_sum + shared.to(dtype).float()).to(dtype)  # the shared row rounded first, as before
        magnitude = torch.maximum(monolith.float().abs(), shared.abs()).to(dtype)
        spacing = (torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude).float()
        stacked, separate = shard_sums(x, weights, ids, gate_up, gate_up_scale, down, down_scale, args.routed)
        row = [f"{tokens:6d}", f"{monolith.numel():8d}"]
        for total in (stacked, separate):
            rounded = total.to(dtype)
            ulps = ((rounded.float() - monolith.float()).abs() / spacing).max()
            row.append(f"{int((rounded != monolith).sum()):6d}, {float(ulps):.1f}")
        row.append(f"{int((before != monolith).sum()):6d}")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
