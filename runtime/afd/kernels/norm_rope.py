"""RMSNorm and rotary embedding as one Triton kernel each: the glue between a layer's GEMMs.

In torch an RMSNorm is seven launches (upcast, square, mean, add, rsqrt, multiply, downcast and
scale) and a rotary embedding about a dozen (cos/sin of the positions, upcast, four products, two
sums, stack or cat, downcast); in a decode step of 1 to 256 tokens each launch costs more than its
arithmetic. These do the same arithmetic as `afd.models.layers`/`rope` (float32 inside, rounded where it
rounds), one launch each; the rotary one reads cos/sin from a table built once by the same torch
formula (`afd.models.rope.Rotary.table`), so its angles are the torch path's bit for bit.
Capturable in CUDA graphs. `AFD_FUSED_GLUE=0` turns them off (the torch path everywhere).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd.config import process_setting
from afd.kernels.pdl import gdc_enter, launch_options


def enabled(x: torch.Tensor) -> bool:
    """Whether `x`'s glue runs through these kernels: on CUDA, unless AFD_FUSED_GLUE=0."""
    return x.is_cuda and process_setting("AFD_FUSED_GLUE")


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, sum_ptr, count, size, stride_x, stride_out, stride_res, stride_sum,
                     eps, BLOCK: tl.constexpr, ROWS: tl.constexpr, RESIDUAL: tl.constexpr, GDC: tl.constexpr = 0):
    gdc_enter(GDC)
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
            num_warps=4 if size <= 1024 else 8, **launch_options(weight.device))
    return total, out


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, heads, max_pos, stride_t, stride_h,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, GDC: tl.constexpr = 0):
    gdc_enter(GDC)
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
                                HALF=half, BLOCK_H=triton.next_power_of_2(heads), INTERLEAVED=interleaved, num_warps=4,
                                **launch_options(x.device))
    return x


@triton.jit
def _rotate(first, second, cos, sin, live):
    """Rotate the pairs at pointers `first`/`second` in place (float32 inside, rounded to their dtype); returns the
    rotated values."""
    a = tl.load(first, mask=live, other=0.0)
    b = tl.load(second, mask=live, other=0.0)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    new_a, new_b = (af * cos - bf * sin).to(a.dtype), (af * sin + bf * cos).to(a.dtype)
    tl.store(first, new_a, mask=live)
    tl.store(second, new_b, mask=live)
    return new_a, new_b


@triton.jit
def _norm_rows_(ptrs, w_ptr, cols, live, size, eps):
    """RMSNorm of the rows at `ptrs` [R, C] in place, as `_rms_norm_kernel` norms them; returns the normed rows."""
    x = tl.load(ptrs, mask=live, other=0.0)
    xf = x.to(tl.float32)
    rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / size + eps)
    normed = (xf * rms[:, None]).to(x.dtype).to(tl.float32)
    weight = tl.load(w_ptr + cols, mask=cols < size, other=0.0).to(tl.float32)
    y = (weight * normed).to(x.dtype)
    tl.store(ptrs, y, mask=live)
    return y


@triton.jit
def _round_e4m3(x):
    """float32 `x` (within ±448) rounded to the nearest e4m3 value, ties to even, still float32: the cast that
    follows is exact, so every backend stores the same bits (Triton's interpreter rounds the cast itself wrongly
    where the mantissa carries). Normals keep 3 of 23 mantissa bits; below 2^-6, multiples of 2^-9."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # -1048576: ~0xFFFFF
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer, ties to even
    subnormal = ((x * 512.0 + magic) - magic) * 0.001953125
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _as_cache(x, cache_ptr, SATURATE: tl.constexpr):
    """`x` as the cache at `cache_ptr` stores it; an FP8 cache (SATURATE = its largest value) saturates and rounds
    to nearest even, as `afd.models.kv_dtype.quantize` does (its static scale is 1)."""
    if SATURATE:
        x = _round_e4m3(tl.minimum(tl.maximum(x.to(tl.float32), -SATURATE), SATURATE))
    return x.to(cache_ptr.dtype.element_ty)


def _saturate(cache: torch.Tensor | None) -> float:
    """The `SATURATE` of a cache tensor: e4m3's largest value for FP8 (the cast saturates there), else 0 (none)."""
    return float(torch.finfo(cache.dtype).max) if cache is not None and cache.dtype == torch.float8_e4m3fn else 0.0


@triton.jit
def _mla_rows_kernel(q_ptr, row_ptr, w_ptr, pos_ptr, cos_ptr, sin_ptr, cache_ptr, index_ptr, heads, max_pos,
                     stride_qt, stride_qh, stride_row, stride_cache, eps, Q_ROPE: tl.constexpr, LATENT: tl.constexpr,
                     BLOCK_L: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, STORE: tl.constexpr,
                     SATURATE: tl.constexpr = 0.0, GDC: tl.constexpr = 0):
    """One token of MLA: its query heads' rotary part (at column Q_ROPE), its latent normed and its rotary key
    rotated (both in place in the row), and, when STORE, the row written to its cache row."""
    gdc_enter(GDC)
    token = tl.program_id(0)
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + token), 0), max_pos - 1).to(tl.int64)
    i = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * HALF + i)
    sin = tl.load(sin_ptr + pos * HALF + i)
    h = tl.arange(0, BLOCK_H)[:, None]
    q = q_ptr + token.to(tl.int64) * stride_qt + h * stride_qh + Q_ROPE + 2 * i[None, :]
    _rotate(q, q + 1, cos[None, :], sin[None, :], h < heads)
    row = row_ptr + token.to(tl.int64) * stride_row
    cols = tl.arange(0, BLOCK_L)
    live = cols[None, :] < LATENT
    latent = _norm_rows_(row + cols[None, :], w_ptr, cols[None, :], live, LATENT, eps)
    key_a, key_b = _rotate(row + LATENT + 2 * i, row + LATENT + 2 * i + 1, cos, sin, i < HALF)
    if STORE:
        dest = cache_ptr + tl.load(index_ptr + token).to(tl.int64) * stride_cache
        tl.store(dest + cols[None, :], _as_cache(latent, cache_ptr, SATURATE), mask=live)
        tl.store(dest + LATENT + 2 * i, _as_cache(key_a, cache_ptr, SATURATE))
        tl.store(dest + LATENT + 2 * i + 1, _as_cache(key_b, cache_ptr, SATURATE))


def mla_rows_(query: torch.Tensor, row: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor | None = None,
              write_index: torch.Tensor | None = None) -> None:
    """MLA's glue after its projections, one launch: rotate `query` [T, heads, nope + rope]'s last `rope` columns
    (DeepSeek's pairs), norm `row` [T, latent + rope]'s latent by `weight` and rotate its last `rope` columns, all in
    place; with `cache` [rows, 1, latent + rope] also write each token's row to cache row `write_index[t]` (what
    `cached_attention` would store; then it need not: a cache of the row's dtype, or FP8, saturated as
    `afd.models.kv_dtype.quantize` saturates). Equals `rope_` on both and `rms_norm` on the latent."""
    tokens, heads, _ = query.shape
    half = cos.shape[1]
    latent = row.shape[1] - 2 * half
    if query.stride(2) != 1 or row.stride(1) != 1 or half & (half - 1):
        raise ValueError("mla_rows_ needs unit-stride rows and a power-of-two rotary half width")
    if cache is not None and (cache.shape[1:] != (1, row.shape[1]) or cache.stride(2) != 1):
        raise ValueError(f"a cache of rows {tuple(cache.shape[1:])} cannot hold MLA rows of {row.shape[1]}")
    if tokens:
        store = cache is not None
        _mla_rows_kernel[(tokens,)](
            query, row, weight, positions, cos, sin, cache if store else row, write_index if store else positions,
            heads, cos.shape[0], query.stride(0), query.stride(1), row.stride(0), cache.stride(0) if store else 0, eps,
            Q_ROPE=query.shape[2] - 2 * half, LATENT=latent, BLOCK_L=triton.next_power_of_2(latent), HALF=half,
            BLOCK_H=triton.next_power_of_2(heads), STORE=store, SATURATE=_saturate(cache), num_warps=4,
            **launch_options(row.device))


@triton.jit
def _qk_rows_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, cos_ptr, sin_ptr, cache_k_ptr, cache_v_ptr,
                    index_ptr, heads, kv_heads, max_pos, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                    stride_vh, stride_ckr, stride_ckh, stride_cvr, stride_cvh, eps_q, eps_k, HALF: tl.constexpr,
                    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, STORE: tl.constexpr, SATURATE: tl.constexpr = 0.0,
                    GDC: tl.constexpr = 0):
    """One token of a normed-q/k attention (Qwen3): every query and key head normed, then rotated (halves), in
    place; when STORE its key and value heads written to the cache row `index[token]`."""
    gdc_enter(GDC)
    token = tl.program_id(0).to(tl.int64)
    dim = tl.arange(0, 2 * HALF)[None, :]
    hq, hk = tl.arange(0, BLOCK_HQ)[:, None], tl.arange(0, BLOCK_HK)[:, None]
    q = q_ptr + token * stride_qt + hq * stride_qh
    k = k_ptr + token * stride_kt + hk * stride_kh
    _norm_rows_(q + dim, qw_ptr, dim, hq < heads, 2 * HALF, eps_q)
    _norm_rows_(k + dim, kw_ptr, dim, hk < kv_heads, 2 * HALF, eps_k)
    tl.debug_barrier()  # the normed rows are in memory before this program reads them back in halves
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + token), 0), max_pos - 1).to(tl.int64)
    i = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + pos * HALF + i)
    sin = tl.load(sin_ptr + pos * HALF + i)
    _rotate(q + i, q + HALF + i, cos, sin, hq < heads)
    key_a, key_b = _rotate(k + i, k + HALF + i, cos, sin, hk < kv_heads)
    if STORE:
        row = tl.load(index_ptr + token).to(tl.int64)
        dest_k = cache_k_ptr + row * stride_ckr + hk * stride_ckh
        tl.store(dest_k + i, _as_cache(key_a, cache_k_ptr, SATURATE), mask=hk < kv_heads)
        tl.store(dest_k + HALF + i, _as_cache(key_b, cache_k_ptr, SATURATE), mask=hk < kv_heads)
        value = tl.load(v_ptr + token * stride_vt + hk * stride_vh + dim, mask=hk < kv_heads, other=0.0)
        tl.store(cache_v_ptr + row * stride_cvr + hk * stride_cvh + dim, _as_cache(value, cache_v_ptr, SATURATE),
                 mask=hk < kv_heads)


def qk_rows_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
             eps_q: float, eps_k: float, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             cache_k: torch.Tensor | None = None, cache_v: torch.Tensor | None = None,
             write_index: torch.Tensor | None = None) -> None:
    """Qwen3's glue after its projections, one launch: RMSNorm of every query head of `q` [T, heads, d] and key
    head of `k` [T, kv_heads, d], then rotary (halves layout) on both, in place; with `cache_k`/`cache_v`
    [rows, kv_heads, d] also each token's key and value `v` [T, kv_heads, d] written to cache row
    `write_index[t]` (an FP8 cache saturated as `afd.models.kv_dtype.quantize` saturates). Equals `rms_norm` then
    `rope_` on each."""
    tokens, heads, dim = q.shape
    half = cos.shape[1]
    if dim != 2 * half or half & (half - 1) or k.shape[2] != dim or v.shape[2] != dim:
        raise ValueError(f"qk_rows_ rotates whole power-of-two heads of {2 * half}; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("qk_rows_ needs unit stride inside a head")
    store = cache_k is not None
    if store and (cache_k.stride(2) != 1 or cache_v.stride(2) != 1):
        raise ValueError("qk_rows_ writes cache rows of unit stride")
    if tokens:
        ck, cv = (cache_k, cache_v) if store else (k, v)
        _qk_rows_kernel[(tokens,)](
            q, k, v, q_weight, k_weight, positions, cos, sin, ck, cv, write_index if store else positions,
            heads, k.shape[1], cos.shape[0], q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), ck.stride(0), ck.stride(1), cv.stride(0), cv.stride(1), eps_q, eps_k, HALF=half,
            BLOCK_HQ=triton.next_power_of_2(heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]), STORE=store,
            SATURATE=_saturate(cache_k), num_warps=4, **launch_options(q.device))
