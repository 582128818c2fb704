"""x @ Wᵀ in float32 for a bf16 `x` and a float32 `W`, on bf16 tensor cores.

A float32 weight is exactly the sum of three bf16 parts (8 + 8 + 8 significand bits cover
float32's 24, and bf16 has float32's exponent range), and the product of two bf16 values
is exact in float32. So one bf16 GEMM of x against the stacked parts [3N, K] with a float32
result, then the sum of its three column blocks, gives x·Wᵀ up to the order of accumulation,
which is all an fp32 GEMM of the same inputs differs by too. DeepSeek's router runs in float32:
this replaces a cast of x and a SIMT fp32 GEMM (see bench/RESULTS.md, thirteenth session).
"""

from __future__ import annotations

import torch


def bf16_parts(weight: torch.Tensor) -> torch.Tensor:
    """[3N, K] bf16: three parts of the float32 `weight` [N, K] whose sum is exactly `weight`
    (largest first)."""
    weight = weight.float()
    high = weight.bfloat16()
    rest = weight - high.float()  # exact: the bits high left out
    middle = rest.bfloat16()
    low = (rest - middle.float()).bfloat16()  # at most 8 significant bits remain: exact
    return torch.cat((high, middle, low))


def linear_fp32(x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """[T, N] float32 = x @ Wᵀ for bf16 `x` [T, K] and `parts` = bf16_parts(W) (CUDA: one GEMM with a float32
    result; elsewhere a float32 matmul of the same parts)."""
    return sum_parts(part_products(x, parts))


def part_products(x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """[T, 3N] float32: x times each part, side by side (one GEMM); `sum_parts` of it is `linear_fp32`. The
    routing kernel takes these blocks as they are and adds them itself (`afd.kernels.routing`, parts=3)."""
    if x.is_cuda:
        return torch.mm(x, parts.t(), out_dtype=torch.float32)
    return x.float() @ parts.float().t()


def sum_parts(blocks: torch.Tensor) -> torch.Tensor:
    """[T, 3N] → [T, N]: high + (middle + low), the small ones first."""
    high, middle, low = blocks.view(blocks.shape[0], 3, -1).unbind(1)
    return high + (middle + low)
