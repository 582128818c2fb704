"""An expert-parallel shard's slice of DeepSeek-V3's one shared expert rounds as the monolith's folded expert does
(issue 32, session 41: EP2 with the gate on attention left the FP8 monolith at greedy token 6 on an H200).

On a GPU the monolith folds the shared expert into the fused MoE kernels; a shard's half of it (1,024 of 2,048
columns) is not a whole expert of the routed width, so it ran as a separate MLP that rounded gate, up, SiLU and
their product to bf16 and quantized down's input from those values. Now the slice runs through the same kernels
(`afd.models.shared_stack`), and the kernels keep a shared expert's row in float32 until the token's sum, in the
monolith too. The kernel tests run on a GPU, or in Triton's interpreter on the CPU (TRITON_INTERPRET=1), in
float16 there; the loading test runs anywhere.
"""

import pytest
import torch
import torch.nn.functional as F

from afd.kernels.fp8_blocks import dequantize_block_fp8, quantize_block_fp8
from afd.models.layers import Experts
from afd.models.shared_stack import SharedStack
from tests.kernel_device import KERNEL_DTYPES, NO_KERNEL_DEVICE, kernel_device

DEVICE = kernel_device()
DTYPE = KERNEL_DTYPES.get(DEVICE)
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=NO_KERNEL_DEVICE)

SMALL_V3 = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, n_routed_experts=8,
                num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128, n_group=4,
                topk_group=2, num_experts_per_tok=2)


def test_an_fp8_shards_shared_slice_is_made_a_stack_for_the_fused_kernels(tmp_path):
    """What `finish_share` does to an FFN shard on a GPU (`fuse_shared_experts`): the half of the one shared expert
    becomes a one-expert FP8 stack holding exactly the slice's weights and scales, returning float32; the shards'
    outputs still add up to the unsharded layer's (CPU: float32, dequantized weights)."""
    from afd.models.fp8 import Fp8Linear
    from afd.models.loader import load_model
    from afd.models.moe_prep import fuse_shared_experts
    from tests.gpu.v3_checkpoint import write_v3_shaped

    _, path = write_v3_shaped(None, tmp_path / "fp8", device="cpu", overrides=SMALL_V3)
    full = load_model(str(path), keep_fp8=True)
    shards = [load_model(str(path), "ffn", False, shard=(shard, 2), keep_fp8=True) for shard in range(2)]
    for shard in shards:
        moe = shard.model.layers[1].mlp
        mlp = moe.shared_experts
        assert isinstance(mlp.gate_proj, Fp8Linear)
        gate, up, down = (dequantize_block_fp8(p.weight, p.weight_scale_inv) for p in
                          (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        fuse_shared_experts(moe)
        stack = moe.shared_experts
        assert isinstance(stack, SharedStack) and moe.experts.num_shared == 0
        assert stack.gate_up.dtype == torch.float8_e4m3fn and stack.down.dtype == torch.float8_e4m3fn
        assert stack.gate_up.shape == (1, 256, 256) and stack.gate_up_scale.shape == (1, 2, 2)
        assert stack.down.shape == (1, 256, 128) and stack.down_scale.shape == (1, 2, 1)
        assert torch.equal(dequantize_block_fp8(stack.gate_up[0], stack.gate_up_scale[0]), torch.cat((gate, up)))
        assert torch.equal(dequantize_block_fp8(stack.down[0], stack.down_scale[0]), down)
    torch.manual_seed(0)
    hidden = torch.randn(9, 256)
    outputs = [shard.model.layers[1].ffn_half(hidden) for shard in shards]
    assert all(out.dtype == torch.float32 for out in outputs)
    torch.testing.assert_close(sum(outputs), full.model.layers[1].ffn_half(hidden), rtol=1e-5, atol=1e-6)


def test_an_unsharded_moe_keeps_its_shared_mlp_when_it_is_not_whole_experts():
    """Only a shard (float32 partial sums) takes a stack: a layer that returns its own dtype keeps its MLP."""
    from afd.models.layers import MoE, Routing
    from afd.models.moe_prep import fuse_shared_experts

    moe = MoE(256, Routing(top_k=2, num_experts=4), 256, 128, fp32_logits=False)
    mlp = moe.shared_experts
    fuse_shared_experts(moe)
    assert moe.shared_experts is mlp
    moe.experts.partial_fp32 = True
    fuse_shared_experts(moe)
    assert isinstance(moe.shared_experts, SharedStack)


def ulp(values: torch.Tensor) -> torch.Tensor:
    """The spacing of DTYPE at |values| (float32)."""
    magnitude = values.to(DTYPE).abs().cpu()
    return (torch.nextafter(magnitude, torch.tensor(float("inf"), dtype=DTYPE)) - magnitude).float()


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 6, 37])
def test_two_shards_with_half_the_shared_expert_each_add_up_to_the_monolith(tokens, monkeypatch):
    """FP8 experts, top-2 of 4 routed plus one shared expert of width 256 (two 128-column blocks): the monolith's
    fused layer, and the sum of two shards' float32 partials (2 routed experts and half the shared columns each,
    `SharedStack`), rounded once as attention rounds it, differ by at most one unit in the last place of the
    larger of |output| and |shared output|, in at most 1% of the elements (the order of float32 additions: the
    shards sum their own pairs first). The shard's former separate MLP (bf16/fp16 gate, up and SiLU·up, down's
    input quantized from those) is outside that bound."""
    from afd.kernels import moe
    from afd.kernels.fp8_gemm import fp8_linear
    from tests.runtime.test_moe_fp8 import blocky

    monkeypatch.setenv("AFD_MOE_KERNEL", "triton")
    monkeypatch.setenv("AFD_FP8_GEMM", "triton")
    monkeypatch.setattr(moe, "device_table", lambda *args: {1: moe.FP8_DEFAULT_CONFIGS[1]})
    hidden, inter, routed, top_k = 256, 256, 4, 2
    generator = torch.Generator().manual_seed(tokens)
    gate_up, gate_up_scale = quantize_block_fp8(blocky(routed + 1, 2 * inter, hidden, generator=generator) * 0.05)
    down, down_scale = quantize_block_fp8(blocky(routed + 1, hidden, inter, generator=generator) * 0.05)
    gate_up, gate_up_scale, down, down_scale = (t.to(DEVICE) for t in (gate_up, gate_up_scale, down, down_scale))
    x = (torch.randn(tokens, hidden, generator=generator) * 2).to(DTYPE).to(DEVICE)
    weights, ids = torch.rand(tokens, routed, generator=generator).topk(top_k, dim=-1)
    weights, ids = weights.to(DTYPE).to(DEVICE), ids.to(DEVICE)

    monolith = moe.experts_cuda(x, weights, ids, gate_up, down, 1, None, gate_up_scale, down_scale)
    shared = SharedStack(gate_up[routed:], down[routed:], gate_up_scale[routed:], down_scale[routed:]).kernels(x)
    half, per_shard = inter // 2, routed // 2
    stacked, separate = [], []
    for shard in range(2):
        experts, cols = slice(shard * per_shard, (shard + 1) * per_shard), slice(shard * half, (shard + 1) * half)
        up_cols = slice(inter + shard * half, inter + (shard + 1) * half)
        blocks, up_blocks = slice(cols.start // 128, cols.stop // 128), slice(up_cols.start // 128, up_cols.stop // 128)
        local = Experts(per_shard, hidden, inter, first=shard * per_shard)
        partial = moe.experts_cuda(x, *local.localize(weights, ids), gate_up[experts], down[experts], 0,
                                   torch.float32, gate_up_scale[experts], down_scale[experts])
        stack = SharedStack(torch.cat((gate_up[routed, cols], gate_up[routed, up_cols]))[None],
                            down[routed, :, cols][None].contiguous(),
                            torch.cat((gate_up_scale[routed, blocks], gate_up_scale[routed, up_blocks]))[None],
                            down_scale[routed, :, blocks][None].contiguous())
        stacked.append(partial + stack.kernels(x))
        gate = fp8_linear(x, gate_up[routed, cols].contiguous(), gate_up_scale[routed, blocks].contiguous())
        up = fp8_linear(x, gate_up[routed, up_cols].contiguous(), gate_up_scale[routed, up_blocks].contiguous())
        separate.append(partial + fp8_linear(F.silu(gate) * up, down[routed, :, cols].contiguous(),
                                             down_scale[routed, :, blocks].contiguous()))
    spacing = ulp(torch.maximum(monolith.float().abs(), shared.abs()))

    def ulps_off(total: torch.Tensor) -> torch.Tensor:
        return (total.to(DTYPE).float() - monolith.float()).abs().cpu() / spacing

    off = ulps_off(sum(stacked))
    differing = int((off > 0).sum())
    assert float(off.max()) <= 1.0 and differing <= monolith.numel() // 100, (float(off.max()), differing)
    before = ulps_off(sum(separate))
    assert float(before.max()) > 1.0 or int((before > 0).sum()) > monolith.numel() // 100


@needs_kernels
def test_the_fused_kernels_keep_a_shared_experts_row_in_float32_until_the_sum(monkeypatch):
    """The monolith's output is the routed pairs' sum plus the shared expert's float32 output, rounded once
    (before: the shared row was rounded to the activations' dtype first, which no shard holding a slice can do)."""
    from afd.kernels import moe

    monkeypatch.setenv("AFD_MOE_KERNEL", "triton")
    monkeypatch.setenv("AFD_MOE_SMALL_TOKENS", "0")  # the aligned kernels (moe_small's own test checks its rounding)
    monkeypatch.setattr(moe, "device_table", lambda *args: {1: moe.DEFAULT_CONFIGS[1]})
    tokens, hidden, inter, routed, top_k = 7, 128, 64, 4, 2
    generator = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(routed + 1, 2 * inter, hidden, generator=generator) * 0.1).to(DTYPE).to(DEVICE)
    down = (torch.randn(routed + 1, hidden, inter, generator=generator) * 0.1).to(DTYPE).to(DEVICE)
    x = torch.randn(tokens, hidden, generator=generator).to(DTYPE).to(DEVICE)
    weights, ids = torch.rand(tokens, routed, generator=generator).topk(top_k, dim=-1)
    weights, ids = weights.to(DTYPE).to(DEVICE), ids.to(DEVICE)
    whole = moe.experts_cuda(x, weights, ids, gate_up, down, 1)
    routed_sum = moe.experts_cuda(x, weights, ids, gate_up[:routed], down[:routed], 0, torch.float32)
    shared = SharedStack(gate_up[routed:], down[routed:]).kernels(x)
    assert shared.dtype == torch.float32 and shared.shape == (tokens, hidden)
    unrounded = shared != shared.to(DTYPE).float()  # a float32 row, not one rounded to DTYPE and widened
    assert int(unrounded.sum()) > shared.numel() // 2
    assert torch.equal(whole, (routed_sum + shared).to(DTYPE))
