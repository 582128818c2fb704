"""FP8 dense GEMMs with DeepSeek-style block scales, for `Fp8Linear` (`afd.models.fp8`).

Weights are float8_e4m3fn [N, K] with one float32 `scale_inv` per 128×128 block; activations are
quantized on the fly per token per 128 columns (1×128: `per_token_group_quant`, one Triton kernel).
The product then runs either through `torch._scaled_mm` with block scales (cuBLASLt's 1×128 × 128×128
recipe on Hopper, where this torch has it) or through the Triton kernel here, which multiplies one
128-column group at a time in FP8 and adds it to a float32 accumulator times both groups' scales.
`AFD_FP8_GEMM` picks one (auto|scaled_mm|triton); auto takes `scaled_mm` on Hopper when the shapes
fit it. Neither synchronises with the host, so both are capturable in CUDA graphs.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from afd.config import process_setting
from afd.kernels import batch_invariant
from afd.kernels.pdl import gdc_enter, launch_options

GROUP = 128  # columns per activation scale, and the weight block's side
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_MIN_SCALE = 1e-10 / FP8_MAX  # an all-zero group: scale of this, values stay zero


# Triton's CPU interpreter converts float32 to e4m3 without carrying a round-up into the exponent (127.6 → 64);
# there the values are first rounded onto the e4m3 grid in float32, so that its conversion is exact
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _onto_e4m3_grid(v):
    """`v` (|v| ≤ 448) rounded to the nearest e4m3 value, in float32: 3 mantissa bits, subnormals below 2^-6."""
    exponent = tl.maximum(tl.floor(tl.log2(tl.abs(v) + 1e-30)), -6.0)
    step = tl.exp2(exponent - 3.0)
    return tl.floor(v / step + 0.5) * step


@triton.jit
def quant_groups(values, FP8_MAX_C: tl.constexpr):
    """[R, G, 128] float32 → (e4m3 values, [R, G] float32 scales): each group divided by its amax / 448."""
    scale = tl.maximum(tl.max(tl.abs(values), axis=2) / FP8_MAX_C, 1e-10 / FP8_MAX_C)
    return quant_scaled(values, scale[:, :, None], FP8_MAX_C), scale


@triton.jit
def quant_scaled(values, scale, FP8_MAX_C: tl.constexpr):
    """float32 `values` ÷ `scale` (broadcast) in e4m3: rounded to nearest even, saturated at ±FP8_MAX_C."""
    quant = tl.clamp(values / scale, -FP8_MAX_C, FP8_MAX_C)
    if _INTERPRETED:
        quant = _onto_e4m3_grid(quant)
    return quant.to(tl.float8e4nv)


@triton.jit(do_not_specialize=["rows", "x_rows"])
def _quant_kernel(x_ptr, q_ptr, s_ptr, rows, x_rows, cols, x_stride, s_row_stride, s_col_stride,
                  BLOCK_R: tl.constexpr, GROUP_C: tl.constexpr, FP8_MAX_C: tl.constexpr, GDC: tl.constexpr = 0):
    """q[r, g·128 + i] = x / scale[r, g] for a block of rows and one column group (columns past `cols`: none);
    rows from `x_rows` to `rows` (padding) are written as zeros."""
    gdc_enter(GDC)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    group = tl.program_id(1)
    c = group * GROUP_C + tl.arange(0, GROUP_C)
    ok = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * x_stride + c[None, :], mask=ok & (r[:, None] < x_rows),
                other=0.0).to(tl.float32)
    quant, scale = quant_groups(tl.reshape(x, (BLOCK_R, 1, GROUP_C)), FP8_MAX_C)
    tl.store(q_ptr + r[:, None].to(tl.int64) * cols + c[None, :], tl.reshape(quant, (BLOCK_R, GROUP_C)), mask=ok)
    tl.store(s_ptr + r.to(tl.int64) * s_row_stride + group * s_col_stride, tl.reshape(scale, (BLOCK_R,)),
             mask=r < rows)


def per_token_group_quant(x: torch.Tensor, group: int = GROUP, column_major_scales: bool = False,
                          pad_rows_to: int = 1):
    """[M, K] → (float8_e4m3fn [M, K], float32 scales [M, ceil(K/group)]): each row's columns in groups of
    `group`, each group divided by its largest magnitude / 448 (the real value is q · scale). With
    `column_major_scales` the scales are laid out M-fastest (stride (1, M)), as `torch._scaled_mm` wants them;
    `pad_rows_to` rounds M up to a multiple (rows of zeros), as cuBLAS's block-scaled GEMM wants it (4)."""
    if x.dim() != 2:
        raise ValueError(f"per_token_group_quant takes a 2-D [tokens, columns] tensor, got shape {tuple(x.shape)}")
    if group != GROUP:
        raise ValueError(f"only groups of {GROUP} columns are supported (got {group})")
    x_rows, cols = x.shape
    rows = triton.cdiv(x_rows, pad_rows_to) * pad_rows_to
    groups = triton.cdiv(cols, group)
    x = x if x.stride(1) == 1 else x.contiguous()
    quant = torch.empty(rows, cols, dtype=FP8, device=x.device)
    if column_major_scales:
        scales = torch.empty_strided((rows, groups), (1, max(rows, 1)), dtype=torch.float32, device=x.device)
    else:
        scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        block_r = 16
        _quant_kernel[(triton.cdiv(rows, block_r), groups)](
            x, quant, scales, rows, x_rows, cols, x.stride(0), scales.stride(0), scales.stride(1),
            BLOCK_R=block_r, GROUP_C=group, FP8_MAX_C=FP8_MAX, num_warps=4, **launch_options(x.device))
    return quant, scales


@triton.jit(do_not_specialize=["rows"])
def _gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, rows, n, k, a_scale_stride,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, GDC: tl.constexpr = 0):
    """out[BM, BN] = Σ over K steps of (a_q @ w_qᵀ) · a_scale[row, group] · w_scale[col block, group]."""
    gdc_enter(GDC)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < rows
    n_ok = offs_n < n
    k_groups = tl.cdiv(k, GROUP_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * k + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * k + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                    other=0.0)
        group = k0 // GROUP_K
        a_s = tl.load(a_scale_ptr + offs_m * a_scale_stride + group, mask=m_ok, other=0.0)
        w_s = tl.load(w_scale_ptr + (offs_n // GROUP_K) * k_groups + group, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * n + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def gemm_settings(rows: int) -> dict:
    """Tile sizes by token count: thin tiles for decode (the weight stream), taller ones for prefill."""
    if rows <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    if rows <= 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    if rows <= 256:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def fp8_gemm_triton(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """[M, N] of `out_dtype` from quantized activations ([M, K] e4m3, [M, K/128] scales) and a block-scaled weight."""
    rows, k = x_q.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=out_dtype, device=x_q.device)
    if rows:
        cfg = gemm_settings(batch_invariant.FP8_ROWS if batch_invariant.enabled() else rows)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(rows, cfg["BLOCK_M"]))
        _gemm_kernel[grid](x_q, x_scale, weight, scale_inv, bias if bias is not None else out, out, rows, n, k,
                           x_scale.stride(0), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=GROUP,
                           GROUP_K=GROUP, HAS_BIAS=bias is not None, num_warps=cfg["num_warps"],
                           num_stages=cfg["num_stages"], **launch_options(out.device, release_early=False))
    return out


SCALED_MM_ROWS = 4  # torch._scaled_mm's block-scaled GEMM takes row counts in multiples of this


def gemm_choice() -> str:
    return process_setting("AFD_FP8_GEMM")  # auto, scaled_mm or triton (a ConfigError names a bad one)


@functools.lru_cache(maxsize=None)
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether cuBLASLt's block-scaled FP8 GEMM takes these shapes: a Hopper GPU, K and N multiples of 128."""
    n, k = weight.shape
    return x.is_cuda and _is_hopper(x.device.index or 0) and k % GROUP == 0 and n % GROUP == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (weight · block scales)ᵀ + bias in x's dtype: `x` [..., K] bf16/fp16, `weight` [N, K] e4m3,
    `scale_inv` float32 [ceil(N/128), ceil(K/128)]; the activations quantized per token per 128 columns."""
    n, k = weight.shape
    if weight.dtype != FP8 or scale_inv.shape != (triton.cdiv(n, GROUP), triton.cdiv(k, GROUP)):
        raise ValueError(f"fp8_linear wants an e4m3 weight [N, K] and float32 scales [ceil(N/128), ceil(K/128)]; "
                         f"got {weight.dtype} {tuple(weight.shape)} and {tuple(scale_inv.shape)}")
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: input has {x.shape[-1]} features, the weight takes {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    choice = gemm_choice()
    use_scaled_mm = choice == "scaled_mm" or (choice == "auto" and scaled_mm_fits(x2, weight))
    use_scaled_mm = use_scaled_mm and not batch_invariant.enabled()  # cuBLASLt's kernel choice sees the rows
    if use_scaled_mm:  # cuBLASLt refuses row counts that are not a multiple of 4 (seen with 1 and 7 on an H200)
        x_q, x_scale = per_token_group_quant(x2, column_major_scales=True, pad_rows_to=SCALED_MM_ROWS)
        out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=scale_inv.t(), out_dtype=x.dtype)
        out = out[: x2.shape[0]]
        if bias is not None:
            out = out + bias
    else:
        x_q, x_scale = per_token_group_quant(x2)
        out = fp8_gemm_triton(x_q, x_scale, weight, scale_inv, bias, x.dtype)
    return out.reshape(*lead, n)
