"""Shared experts folded into FP8 expert stacks keep their block scales (pure torch, CPU)."""

import torch

from afd.kernels.moe import add_shared
from afd.kernels.fp8_blocks import dequantize_block_fp8, quantize_block_fp8
from afd.models.fp8 import Fp8Linear
from afd.models.layers import MoE, Routing
from afd.models.moe_prep import fuse_shared_experts

HIDDEN, WIDTH, SHARED, ROUTED = 256, 128, 2, 4


def fp8_moe() -> MoE:
    """A MoE whose routed stacks and shared projections are FP8 with block scales that differ per block."""
    torch.manual_seed(0)
    moe = MoE(HIDDEN, Routing(top_k=2, num_experts=ROUTED), WIDTH, SHARED * WIDTH, fp32_logits=False)
    moe.requires_grad_(False)
    for param in moe.parameters():
        param.normal_(0, 0.05)
    experts = moe.experts
    for name in ("gate_up", "down"):
        blocks = torch.rand(ROUTED, *(-(-n // 128) for n in getattr(experts, name).shape[1:])) * 4
        scaled = getattr(experts, name) * blocks.repeat_interleave(128, 1).repeat_interleave(128, 2)
        quant, scale = quantize_block_fp8(scaled)
        setattr(experts, name, torch.nn.Parameter(quant, requires_grad=False))
        setattr(experts, f"{name}_scale", scale)
    for name in ("gate_proj", "up_proj", "down_proj"):
        linear = getattr(moe.shared_experts, name)
        fp8 = Fp8Linear(linear.in_features, linear.out_features, dtype=torch.float32)
        fp8.weight, fp8.weight_scale_inv = quantize_block_fp8(linear.weight * (1 + torch.rand(1) * 3))
        setattr(moe.shared_experts, name, fp8)
    return moe


def test_fused_fp8_shared_experts_compute_what_the_separate_mlp_did():
    moe = fp8_moe()
    x = torch.randn(5, HIDDEN)
    weights, ids = moe.routing.select(moe.gate(x), x.dtype)
    separate = moe(x)
    fuse_shared_experts(moe)
    experts = moe.experts
    assert moe.shared_experts is None and experts.num_shared == SHARED
    assert experts.gate_up.dtype == torch.float8_e4m3fn and experts.gate_up_scale.shape == (ROUTED + SHARED, 2, 2)
    assert experts.down.dtype == torch.float8_e4m3fn and experts.down_scale.shape == (ROUTED + SHARED, 2, 1)
    fused = experts(x, *add_shared(weights, ids, ROUTED, SHARED))
    torch.testing.assert_close(fused, separate, rtol=1e-4, atol=1e-5)


def test_shared_experts_of_another_format_stay_apart():
    moe = fp8_moe()
    shared = moe.shared_experts
    shared.down_proj = torch.nn.Linear(SHARED * WIDTH, HIDDEN, bias=False)  # a bf16/fp32 projection among FP8
    fuse_shared_experts(moe)
    assert moe.shared_experts is shared and moe.experts.num_shared == 0 and moe.experts.gate_up_scale.shape[0] == ROUTED


def test_dequantized_fused_stack_equals_the_projections():
    moe = fp8_moe()
    gate = dequantize_block_fp8(moe.shared_experts.gate_proj.weight, moe.shared_experts.gate_proj.weight_scale_inv)
    down = dequantize_block_fp8(moe.shared_experts.down_proj.weight, moe.shared_experts.down_proj.weight_scale_inv)
    fuse_shared_experts(moe)
    experts = moe.experts
    gate_up = dequantize_block_fp8(experts.gate_up, experts.gate_up_scale)
    stacked_down = dequantize_block_fp8(experts.down, experts.down_scale)
    assert torch.equal(gate_up[ROUTED + 1, :WIDTH], gate[WIDTH:])  # the second shared expert's gate rows
    assert torch.equal(stacked_down[ROUTED + 1], down[:, WIDTH:])  # and its down columns
