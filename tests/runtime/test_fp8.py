"""FP8 block format helpers: our quantizer, the dequantizer and Fp8Linear off the GPU."""

import pytest
import torch

from afd.kernels.fp8_blocks import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8
from afd.models.fp8 import Fp8Linear


@pytest.mark.parametrize("shape", [(256, 384), (130, 70), (3, 200, 129)])
def test_quantize_then_dequantize_is_close_and_blockwise(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[-1])  # columns of very different magnitudes
    w_fp8, scale = quantize_block_fp8(w)
    assert w_fp8.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert scale.shape == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    back = dequantize_block_fp8(w_fp8, scale)
    # e4m3 has 3 mantissa bits: relative rounding error at most 2^-4 of each block's range
    blocks_max = scale * 448
    expanded = blocks_max.repeat_interleave(128, -2)[..., : shape[-2], :].repeat_interleave(128, -1)[..., : shape[-1]]
    assert ((back - w).abs() <= expanded / 16 + 1e-12).all()
    assert (w_fp8.float().abs().amax() <= 448)


def test_dequantize_of_exact_values_is_exact():
    scale = torch.tensor([[0.5, 2.0]])
    w_fp8 = torch.tensor([[1.0, -3.0] * 64 + [4.0, 0.25] * 64]).to(FP8_DTYPE)
    out = dequantize_block_fp8(w_fp8, scale)
    assert out[0, :2].tolist() == [0.5, -1.5] and out[0, 128:130].tolist() == [8.0, 0.5]


def test_dequantize_refuses_a_scale_of_the_wrong_shape():
    with pytest.raises(ValueError, match="does not fit a 128x256 weight"):
        dequantize_block_fp8(torch.zeros(128, 256).to(FP8_DTYPE), torch.ones(1, 1))


def test_fp8_linear_on_cpu_is_the_linear_of_the_dequantized_weight():
    torch.manual_seed(1)
    layer = Fp8Linear(200, 150, bias=True, dtype=torch.float32)
    w_fp8, scale = quantize_block_fp8(torch.randn(150, 200))
    layer.weight.copy_(w_fp8)
    layer.weight_scale_inv.copy_(scale)
    layer.bias.data.normal_()
    x = torch.randn(5, 200)
    expected = torch.nn.functional.linear(x, dequantize_block_fp8(w_fp8, scale), layer.bias)
    assert torch.equal(layer(x), expected)
    assert layer.weight.dtype == FP8_DTYPE and layer.out_features == 150
