"""RMSNorm and rotary embedding as one Triton kernel each: the glue between a layer's GEMMs.

In torch an RMSNorm is seven launches (upcast, square, mean, add, rsqrt, multiply, downcast and
scale) and a rotary embedding about a dozen (cos/sin of the positions, upcast, four products, two
sums, stack or cat, downcast); in a decode step of 1 to 256 tokens each launch costs more than its
arithmetic. These do the same arithmetic as `afd.models.layers` (float32 inside, rounded where it
rounds), one launch each; the rotary one reads cos/sin from a table built once by the same torch
formula (`afd.models.layers.rope_table`), so its angles are the torch path's bit for bit.
Capturable in CUDA graphs. `AFD_FUSED_GLUE=0` turns them off (the torch path everywhere).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def enabled(x: torch.Tensor) -> bool:
    """Whether `x`'s glue runs through these kernels: on CUDA, unless AFD_FUSED_GLUE=0."""
    return x.is_cuda and os.environ.get("AFD_FUSED_GLUE", "1") != "0"


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, sum_ptr, count, size, stride_x, stride_out, stride_res, stride_sum,
                     eps, BLOCK: tl.constexpr, ROWS: tl.constexpr, RESIDUAL: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    live = (rows[:, None] < count) & (cols[None, :] < size)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=live, other=0.0)
    if RESIDUAL:  # x + residual, rounded to x's dtype as torch's add rounds, then normed
        res = tl.load(res_ptr + rows[:, None].to(tl.int64) * stride_res + cols[None, :], mask=live, other=0.0)
        x = (res.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + rows[:, None].to(tl.int64) * stride_sum + cols[None, :], x, mask=live)
    xf = x.to(tl.float32)
    rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / size + eps)
    normed = (xf * rms[:, None]).to(x.dtype).to(tl.float32)  # rounded to the input's dtype, as torch does
    weight = tl.load(w_ptr + cols, mask=cols < size, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
             (weight[None, :] * normed).to(out_ptr.dtype.element_ty), mask=live)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`RMSNorm` of `x` [..., D]: weight * (x * rsqrt(mean(x²) + eps)) in float32, rounded to x's dtype before
    the weight; into `out` when given (it may be `x` itself: each row is read before it is written)."""
    return _launch(x, weight, eps, out, None)[1]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, its RMSNorm) in one launch: the sum rounded to x's dtype, as `residual + x` is, then normed
    exactly as `rms_norm` norms it."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"a residual {tuple(residual.shape)} {residual.dtype} cannot be added to {tuple(x.shape)} {x.dtype}")
    return _launch(x, weight, eps, None, residual)


def _launch(x, weight, eps, out, residual):
    size = x.shape[-1]
    if weight.shape != (size,):
        raise ValueError(f"an RMSNorm weight of shape {tuple(weight.shape)} cannot scale rows of {size}")
    rows2d = _rows(x)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    out2d = out if out.dim() == 2 else out.view(-1, size)
    if out2d.stride(-1) != 1:
        raise ValueError("rms_norm writes rows with unit stride")
    total = res2d = sum2d = None
    if residual is not None:
        res2d = _rows(residual)
        total = torch.empty_like(x, memory_format=torch.contiguous_format)
        sum2d = total.view(-1, size)
    count = rows2d.shape[0]
    if count:
        rows_per_program = 4 if size <= 256 else 1
        _rms_norm_kernel[(triton.cdiv(count, rows_per_program),)](
            rows2d, weight, out2d, rows2d if res2d is None else res2d, rows2d if sum2d is None else sum2d, count, size,
            rows2d.stride(0), out2d.stride(0), 0 if res2d is None else res2d.stride(0),
            0 if sum2d is None else sum2d.stride(0), eps,
            BLOCK=triton.next_power_of_2(size), ROWS=rows_per_program, RESIDUAL=residual is not None,
            num_warps=4 if size <= 1024 else 8)
    return total, out


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, heads, max_pos, stride_t, stride_h,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr):
    token = tl.program_id(0)
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + token), 0), max_pos - 1).to(tl.int64)  # never past the table
    i = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * HALF + i)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + i)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    base = x_ptr + token.to(tl.int64) * stride_t + h * stride_h
    if INTERLEAVED:  # pairs (2i, 2i+1), the DeepSeek layout
        first, second = base + 2 * i[None, :], base + 2 * i[None, :] + 1
    else:  # halves (i, i + HALF), the Llama/Qwen layout
        first, second = base + i[None, :], base + HALF + i[None, :]
    live = h < heads
    a = tl.load(first, mask=live, other=0.0)
    b = tl.load(second, mask=live, other=0.0)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    tl.store(first, (af * cos - bf * sin).to(a.dtype), mask=live)
    tl.store(second, (af * sin + bf * cos).to(a.dtype), mask=live)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate `x` [T, heads, 2·half] in place at `positions` [T] with the [max positions, half] tables; returns x."""
    tokens, heads, dim = x.shape
    half = cos.shape[1]
    if dim != 2 * half or x.stride(2) != 1:
        raise ValueError(f"rope_ rotates [T, heads, {2 * half}] with unit stride, got {tuple(x.shape)}")
    if half & (half - 1):
        raise ValueError(f"rope_ needs a power-of-two half width, got {half}")
    if tokens:
        _rope_kernel[(tokens,)](x, positions, cos, sin, heads, cos.shape[0], x.stride(0), x.stride(1),
                                HALF=half, BLOCK_H=triton.next_power_of_2(heads), INTERLEAVED=interleaved, num_warps=4)
    return x
