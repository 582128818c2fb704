"""FP8 experts (e4m3 stacks, 128×128 block scales, activations quantized per token per 128 columns) in the
Triton MoE and the FP8 dense GEMM equal their references on the dequantized weights.

On a GPU the kernels run there in bf16; without one in Triton's CPU interpreter (TRITON_INTERPRET=1 before
Triton is imported, Triton 3.7+) in float16, as the other Triton MoE tests do; otherwise these tests skip.
Weights and activations get a different magnitude per 128-block, so a scale read from the wrong block shows.
"""

import pytest
import torch

from tests.kernel_device import KERNEL_DTYPES, NO_KERNEL_DEVICE, kernel_device

from afd.kernels.fp8_blocks import dequantize_block_fp8, quantize_block_fp8
from afd.kernels.moe import FP8_DEFAULT_CONFIGS

DEVICE = kernel_device()
DTYPE = KERNEL_DTYPES.get(DEVICE)
pytestmark = pytest.mark.skipif(DEVICE is None, reason=NO_KERNEL_DEVICE)

# e4m3 keeps 3 mantissa bits: quantizing the activations costs ~2-3% of a product's norm (more under the
# interpreter, whose e4m3 conversion rounds less carefully); a scale taken from the wrong block costs ~100%
TOLERANCE = 0.06


def blocky(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """Random normal values whose 128×128 blocks (of the last two dims) differ in magnitude by up to 2^±3."""
    values = torch.randn(*shape, generator=generator, dtype=torch.float64)
    blocks = (-(-shape[-2] // 128), -(-shape[-1] // 128))
    factors = 2.0 ** torch.randint(-3, 4, (*shape[:-2], *blocks), generator=generator).double()
    return values * factors.repeat_interleave(128, -2)[..., : shape[-2], :].repeat_interleave(128, -1)[..., : shape[-1]]


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.double().cpu() - reference).norm() / reference.norm())


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    """[R, C] float64 → the values its per-row 128-column e4m3 quantization stands for (torch's rounding)."""
    groups = [x[:, start:start + 128] for start in range(0, x.shape[1], 128)]
    out = []
    for group in groups:
        scale = (group.abs().amax(1, keepdim=True).float() / 448).clamp(min=1e-10 / 448)
        out.append((group.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale.double())
    return torch.cat(out, 1)


def quantized_moe_reference(x, weights, ids, gate_up, down, num_shared: int) -> torch.Tensor:
    """The FP8 MoE's own arithmetic in float64: tokens and SiLU·up quantized per 128 columns, dequantized
    weights, each token's pairs summed."""
    from afd.kernels.moe import add_shared

    weights, ids = add_shared(weights, ids, gate_up.shape[0] - num_shared, num_shared)
    x_q = fake_quant(x.double())
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = down.shape[2]
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token].tolist(), ids[token].tolist()):
            h = x_q[token:token + 1] @ gate_up[expert].T
            act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            out[token] += weight * (fake_quant(act) @ down[expert].T)[0]
    return out


def test_per_token_group_quant_reconstructs_each_group():
    from afd.kernels.fp8_gemm import per_token_group_quant

    generator = torch.Generator().manual_seed(0)
    x = blocky(5, 300, generator=generator) * 10  # 300: a partial last group
    q, scales = per_token_group_quant(x.to(DTYPE).to(DEVICE))
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (5, 3) and scales.dtype == torch.float32
    x = x.to(DTYPE).double()
    amax = torch.stack([x[:, g * 128:(g + 1) * 128].abs().amax(1) for g in range(3)], 1)
    torch.testing.assert_close(scales.cpu().double(), amax / 448, rtol=1e-6, atol=0)
    rebuilt = q.cpu().double() * scales.cpu().double().repeat_interleave(128, 1)[:, :300]
    assert bool(((rebuilt - x).abs() <= x.abs() / 8 + 1e-5 * amax.repeat_interleave(128, 1)[:, :300]).all())
    _, column_major = per_token_group_quant(x.to(DTYPE).to(DEVICE), column_major_scales=True)
    assert column_major.stride() == (1, 5) and torch.equal(column_major.cpu(), scales.cpu())


@pytest.mark.parametrize("rows", [1, 33, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemm_equals_the_dequantized_linear(rows, bias, monkeypatch):
    from afd.kernels import fp8_gemm

    monkeypatch.setenv("AFD_FP8_GEMM", "triton")
    generator = torch.Generator().manual_seed(rows)
    weight, scale_inv = quantize_block_fp8(blocky(320, 384, generator=generator) * 0.05)  # N 320: a partial block
    x = blocky(rows, 384, generator=generator)
    b = torch.randn(320, generator=generator, dtype=torch.float64) if bias else None
    reference = x.to(DTYPE).double() @ dequantize_block_fp8(weight, scale_inv, torch.float64).T
    if bias:
        reference = reference + b.to(DTYPE).double()
    out = fp8_gemm.fp8_linear(x.to(DTYPE).to(DEVICE).view(rows, 1, 384), weight.to(DEVICE), scale_inv.to(DEVICE),
                              b.to(DTYPE).to(DEVICE) if bias else None)
    assert out.shape == (rows, 1, 320) and out.dtype == DTYPE
    assert relative_error(out.view(rows, 320), reference) < TOLERANCE
    quantized = fake_quant(x.to(DTYPE).double()) @ dequantize_block_fp8(weight, scale_inv, torch.float64).T
    if bias:
        quantized = quantized + b.to(DTYPE).double()
    assert relative_error(out.view(rows, 320), quantized) < 1e-2  # the same quantization: rounding only


def test_fp8_linear_refuses_a_weight_without_block_scales():
    from afd.kernels.fp8_gemm import fp8_linear

    weight = torch.zeros(256, 128, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="float32 scales"):
        fp8_linear(torch.zeros(2, 128, dtype=DTYPE, device=DEVICE), weight, torch.ones(1, 1, device=DEVICE))


def fp8_experts(num_experts: int, hidden: int, inter: int, generator: torch.Generator):
    """(gate_up e4m3, gate_up_scale, down e4m3, down_scale) of random block-varied experts."""
    gate_up, gate_up_scale = quantize_block_fp8(blocky(num_experts, 2 * inter, hidden, generator=generator) * 0.05)
    down, down_scale = quantize_block_fp8(blocky(num_experts, hidden, inter, generator=generator) * 0.05)
    return gate_up, gate_up_scale, down, down_scale


def kernel(block_n=128, block_k=128, **new_keys):
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3, **new_keys}


FP8_SETTINGS = {  # id → a table entry for FP8 experts (gate_up's BLOCK_N a multiple of 128, BLOCK_K divides 128)
    "pointers": {"BLOCK_M": 16, "gate_up": kernel(), "down": kernel(64, 64)},
    "wide-gate-up-half-tiles": {"BLOCK_M": 32, "gate_up": kernel(256, 64, BLOCK_M=16, GROUP_M=2),
                                "down": kernel(32, BLOCK_M=16)},
    "tma-gather-persistent": {"BLOCK_M": 16, "gate_up": kernel(TMA=True, GATHER=True, PERSISTENT=1),
                              "down": kernel(64, TMA=True, PERSISTENT=1, GROUP_M=2)},
    "one-dot-tma": {"BLOCK_M": 32, "gate_up": kernel(block_k=64, TMA=True, ONE_DOT=True),
                    "down": kernel(TMA=True)},
    "gather-pointers-one-dot-gather": {"BLOCK_M": 16, "gate_up": kernel(TMA=True, GATHER=True, ONE_DOT=True),
                                       "down": kernel(128, 32)},
    # columns over two weight blocks: a scale per column (BLOCK_N <= 128 takes one scale per block and step)
    "one-dot-wide-down-wide": {"BLOCK_M": 32, "gate_up": kernel(256, TMA=True, ONE_DOT=True),
                               "down": kernel(256, TMA=True, BLOCK_M=16)},
    # gate_up's column block in two passes of one dot (half the gate columns beside the same half's up columns)
    "halves-pointers": {"BLOCK_M": 32, "gate_up": kernel(HALVES=True, GROUP_M=2), "down": kernel(TMA=True)},
    "halves-tma-gather-half-tiles": {"BLOCK_M": 32, "gate_up": kernel(block_k=64, BLOCK_M=16, TMA=True, GATHER=True,
                                                                      HALVES=True), "down": kernel(64, 64, BLOCK_M=16)},
    **{f"default-{tokens}": FP8_DEFAULT_CONFIGS[tokens] for tokens in (1024, 4096)},  # the tall untuned ones
}


@pytest.mark.parametrize("tokens", [1, 37, 130])
@pytest.mark.parametrize("name", sorted(FP8_SETTINGS))
def test_fp8_moe_equals_the_dequantized_experts(name, tokens, monkeypatch):
    from afd.kernels import moe
    from afd.kernels.moe import add_shared
    from afd.models.layers import Experts

    routed, num_shared, top_k, hidden, inter = 8, 1, 3, 320, 256  # hidden 320: a partial scale block
    monkeypatch.setenv("AFD_MOE_KERNEL", "triton")
    monkeypatch.setattr(moe, "device_table", lambda *args: {1: FP8_SETTINGS[name]})
    generator = torch.Generator().manual_seed(tokens)
    gate_up, gate_up_scale, down, down_scale = fp8_experts(routed + num_shared, hidden, inter, generator)
    reference_experts = Experts(routed + num_shared, hidden, inter).requires_grad_(False).double()
    reference_experts.gate_up.copy_(dequantize_block_fp8(gate_up, gate_up_scale, torch.float64))
    reference_experts.down.copy_(dequantize_block_fp8(down, down_scale, torch.float64))
    x = blocky(tokens, hidden, generator=generator).to(DTYPE)
    weights, ids = torch.rand(tokens, routed, generator=generator, dtype=torch.float64).topk(top_k, dim=-1)
    reference = reference_experts(x.double(), *add_shared(weights, ids, routed, num_shared))
    out = moe.experts_cuda(x.to(DEVICE), weights.to(DTYPE).to(DEVICE), ids.to(DEVICE), gate_up.to(DEVICE),
                           down.to(DEVICE), num_shared, None, gate_up_scale.to(DEVICE), down_scale.to(DEVICE))
    assert out.dtype == DTYPE and out.shape == (tokens, hidden)
    assert relative_error(out, reference) < TOLERANCE
    quantized = quantized_moe_reference(x, weights, ids, reference_experts.gate_up, reference_experts.down,
                                        num_shared)
    assert relative_error(out, quantized) < 2e-2  # the same quantization: only rounding and summation order


def test_fp8_experts_without_their_scales_are_refused():
    from afd.kernels.moe import check_fp8

    fp8 = torch.zeros(2, 256, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="both block scales"):
        check_fp8(fp8, fp8.view(2, 128, 256), None, None)
    with pytest.raises(ValueError, match="need I % 128 == 0"):
        check_fp8(fp8, fp8.view(2, 128, 256), torch.ones(2, 2, 1), torch.ones(2, 2, 2))


def test_padded_quantization_adds_rows_of_zeros():
    from afd.kernels.fp8_gemm import per_token_group_quant

    x = torch.randn(7, 256, dtype=DTYPE).to(DEVICE)
    q, scales = per_token_group_quant(x, column_major_scales=True, pad_rows_to=4)
    assert q.shape == (8, 256) and scales.shape == (8, 2) and scales.stride() == (1, 8)
    assert not bool(q[7].float().any())
    unpadded_q, unpadded_scales = per_token_group_quant(x)
    assert torch.equal(q[:7].view(torch.uint8), unpadded_q.view(torch.uint8))
    assert torch.equal(scales[:7], unpadded_scales)
