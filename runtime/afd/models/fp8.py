"""`Fp8Linear`: a linear layer whose weight stays FP8 block-quantized (the format: `afd.kernels.fp8_blocks`).

Activations are quantized on the fly (1×B groups), by the GPU kernels (`afd.kernels.fp8_gemm`);
off the GPU an `Fp8Linear` multiplies by its dequantized weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afd.kernels.fp8_blocks import BLOCK, FP8_DTYPE, dequantize_block_fp8, scale_shape


class Fp8Linear(nn.Module):
    """A linear layer whose weight stays FP8 with block scales. On CUDA the FP8 GEMM of
    `afd.kernels.fp8_gemm` (activations quantized per token per 128 columns); elsewhere F.linear
    with the dequantized weight (what the checkpoint's authors define the weight to be)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None,
                 dtype: torch.dtype = torch.bfloat16, block: int = BLOCK):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale_inv",
                             torch.empty(scale_shape(out_features, in_features, block), dtype=torch.float32,
                                         device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from afd.kernels.fp8_gemm import fp8_linear  # local import: Triton is optional (CPU installs have none): loaded where its kernel runs

            return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)
        return F.linear(x, dequantize_block_fp8(self.weight, self.weight_scale_inv, x.dtype, self.block), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks {self.block}x{self.block}"
