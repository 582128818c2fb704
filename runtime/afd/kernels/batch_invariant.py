"""Batch-invariant mode (`AFD_BATCH_INVARIANT`): a token's result no longer depends on what shares its step.

cuBLAS picks its GEMM kernel (tile, split-K) by the row count, so the same token's projections round differently
in a step of 256 rows than in one of 16 (bench/kernels/gemm_invariance.py). Where attention ranks split the requests
(2A1F), each rank's steps hold other rows than the monolith's, and bf16 greedy tokens can part (issue 32). In
this mode every dense product of 16-bit or float32 CUDA tensors (aten mm, addmm, bmm and their out/dtype forms,
so nn.Linear, the LM head, the router and MLA's absorptions alike) runs one Triton kernel with one fixed tiling
whatever the row count: each output row is its own row times the weight, summed over K in one fixed order. The
other kernels keep their per-row order fixed too: the skinny GEMM's per-row-count table is not read, the MoE uses
one setting for every token count and no small-token path, decode attention reads each sequence's keys in one
slice, FP8 projections take the Triton GEMM at one setting. Norms, rotary, routing and the prompt attention
kernels are per row (or per sequence) already. Slower (no per-shape tuning): for determinism, RL
rollouts and parity tests, not for speed.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from afd.config.process import process_setting

BLOCK_M, BLOCK_N, GROUP_M = 64, 64, 8  # one tiling for every shape: the point of the mode
BLOCK_K = {torch.float32: 32}  # 16-bit inputs: 64
WARPS, STAGES = 4, 3
DECODE_SPLITS = 1  # decode attention's key slices per sequence whatever the batch (no partials' workspace either)
MOE_TOKENS = 1  # the MoE table entry every token count uses (afd.kernels.moe)
FP8_ROWS = 64  # the FP8 GEMM setting every row count uses (afd.kernels.fp8_gemm.gemm_settings)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_library = None  # the aten registrations while installed (dropping the Library object removes them)


def enabled() -> bool:
    """Whether this process runs in batch-invariant mode (`AFD_BATCH_INVARIANT`, read now)."""
    return process_setting("AFD_BATCH_INVARIANT")


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_ab, stride_am, stride_ak, stride_bb, stride_bk,
                   stride_bn, stride_cb, stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    pid, batch = tl.program_id(0), tl.program_id(1).to(tl.int64)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group_width = GROUP_M * tiles_n  # tiles in GROUP_M row blocks, column-major within (reuse in L2)
    first_m = (pid // group_width) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_width) % group_m
    pid_n = (pid % group_width) // group_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a = a_ptr + batch * stride_ab + rows[:, None].to(tl.int64) * stride_am
    b = b_ptr + batch * stride_bb + cols[None, :].to(tl.int64) * stride_bn
    live_m, live_n = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):  # one order for every row count: a row's sum does not see M
        live_k = k + ks < K
        a_tile = tl.load(a + (k + ks)[None, :].to(tl.int64) * stride_ak, mask=live_m[:, None] & live_k[None, :],
                         other=0.0)
        b_tile = tl.load(b + (k + ks)[:, None].to(tl.int64) * stride_bk, mask=live_k[:, None] & live_n[None, :],
                         other=0.0)
        acc = tl.dot(a_tile, b_tile, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=live_n, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + batch * stride_cb + rows[:, None].to(tl.int64) * stride_cm + cols[None, :].to(tl.int64) * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=live_m[:, None] & live_n[None, :])


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (or batched: [B, M, K] @ [B, K, N]) by the one-tiling kernel, into `out` (any strides)
    or a new tensor of `out_dtype` (default a's); `bias` [N] added in float32 before the rounding."""
    batched = a.dim() == 3
    if a.dim() != b.dim() or a.dim() not in (2, 3) or a.shape[-1] != b.shape[-2] or \
            (batched and a.shape[0] != b.shape[0]):
        raise RuntimeError(f"batch-invariant matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be "
                           "multiplied")
    if a.dtype != b.dtype or a.dtype not in DTYPES:
        raise RuntimeError(f"batch-invariant matmul takes two {'/'.join(str(d) for d in DTYPES)} operands of one "
                           f"dtype, got {a.dtype} and {b.dtype}")
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    shape = (a.shape[0], m, n) if batched else (m, n)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device)
    elif tuple(out.shape) != shape:
        raise RuntimeError(f"batch-invariant matmul: out has shape {tuple(out.shape)}, the product {shape}")
    if out.numel() == 0:
        return out
    a3, b3, c3 = (t if batched else t.unsqueeze(0) for t in (a, b, out))
    precision = "ieee" if a.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
    grid = (-(-m // BLOCK_M) * -(-n // BLOCK_N), a3.shape[0])
    _matmul_kernel[grid](a3, b3, c3, bias if bias is not None else c3, m, n, k, *a3.stride(), *b3.stride(),
                           *c3.stride(), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K.get(a.dtype, 64),
                           GROUP_M=GROUP_M, HAS_BIAS=bias is not None, PRECISION=precision, num_warps=WARPS,
                           num_stages=STAGES)
    return out


# ---------------------------------------------------------------- aten registrations
def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.dtype in DTYPES for t in tensors) and len({t.dtype for t in tensors}) == 1


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b without aten's matmuls (which this mode replaces): for dtypes the kernel does not take (float64,
    complex); one fixed order too."""
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)


def _mm(a, b):
    return matmul(a, b) if _fits(a, b) else _reference(a, b)


def _check_out(out: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse an `out` of another dtype than the product's, as aten's `.out` forms do (no silent cast into it)."""
    if out.dtype != dtype:
        raise RuntimeError(f"batch-invariant matmul: expected out tensor to have dtype {dtype}, but got {out.dtype} "
                           "instead")


def _mm_out(a, b, *, out):
    _check_out(out, a.dtype)
    if _fits(a, b, out):
        return matmul(a, b, out=out)
    return out.copy_(_reference(a, b))


def _mm_dtype(a, b, out_dtype):
    return matmul(a, b, out_dtype=out_dtype)


def _mm_dtype_out(a, b, out_dtype, *, out):
    _check_out(out, out_dtype)
    return matmul(a, b, out=out)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == b.shape[1] and _fits(a, b, bias):
        return matmul(a, b, bias=bias.contiguous())  # nn.Linear's bias: added before the one rounding, as cuBLAS does
    product = _mm(a, b)
    product = product if alpha == 1 else product * alpha
    if beta == 0:  # torch ignores self then (NaN and inf in it included)
        return product
    return product + (bias if beta == 1 else bias * beta)


def _addmm_out(bias, a, b, *, beta=1, alpha=1, out):
    return out.copy_(_addmm(bias, a, b, beta=beta, alpha=alpha))


OVERRIDES = {"mm": _mm, "mm.out": _mm_out, "mm.dtype": _mm_dtype, "mm.dtype_out": _mm_dtype_out, "addmm": _addmm,
             "addmm.out": _addmm_out, "bmm": _mm, "bmm.out": _mm_out, "bmm.dtype": _mm_dtype,
             "bmm.dtype_out": _mm_dtype_out}


def install(dispatch_key: str = "CUDA") -> bool:
    """Route aten's dense products on `dispatch_key` tensors to `matmul` for the rest of the process (tests:
    until `uninstall`); idempotent. Returns whether this call installed them."""
    global _library
    if _library is not None:
        return False
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        for name, function in OVERRIDES.items():
            library.impl(name, function, dispatch_key)
    _library = library
    return True


def uninstall() -> None:
    """Drop the registrations: aten's own kernels again."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None


def installed() -> bool:
    return _library is not None
