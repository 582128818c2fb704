"""Paged decode attention in Triton: one new query per sequence, keys read through block tables.

The cache may be FP8 (e4m3, static scale 1: `afd.models.kv_dtype`): its rows are converted to the queries' dtype
as they are loaded, half the bytes read for the same dots.

Graph-friendly: every shape is (batch, heads, dims); each sequence's length is read on
the device, so one captured graph serves any mix of context lengths up to the table width.
A program serves every query head that shares a key head (MLA: a block of 16 heads of the one
latent row, 64 with DeepSeek-V3's 128), so each cached row is read once per key head, and each
sequence's keys are cut into as many slices as give the device two programs a multiprocessor
(`plan_splits`: many at batch 1, one from ~264 programs up), merged by a second small kernel
(flash-decoding); slices and launch settings were measured against the KV byte floor
(`bench/kernels/decode_tune.py`). The slice count is an argument, not a compile-time constant: an eager
step (decodes beside a prompt) meets every count from 1 to 16, and each compiled variant cost a JIT
compile in the middle of serving (issue 33: TTFT 0.7-6 s at 16-64 streams); two variants remain.
The block tables' width (the step's longest sequence, in blocks) is not specialized on either
(Triton would compile apart widths of 1 and multiples of 16).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from afd.kernels import batch_invariant
from afd.kernels.pdl import gdc_enter, launch_options


@triton.jit(do_not_specialize=["splits", "table_width"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, stat_ptr, table_ptr, lens_ptr,
    heads, table_width, block_size, group, scale, splits,
    stride_qb, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_ob, stride_oh,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, GDC: tl.constexpr = 0,
):
    """One program: the `group` query heads of one key head of one sequence, over one of `splits` slices of
    its keys (each key and value row is read once per key head, on tensor cores)."""
    gdc_enter(GDC)
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lens_ptr + seq)
    begin, end = _split_range(length, split, splits, BLOCK_N)
    rows_h = tl.arange(0, BLOCK_H)
    live_h = rows_h < group
    offs_h = kv_head * group + rows_h
    offs_dk, offs_dv = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + seq * stride_qb + offs_h[:, None] * stride_qh + offs_dk[None, :],
                mask=live_h[:, None] & (offs_dk[None, :] < DK), other=0.0)  # [BH, BDK]
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)
    for start in range(begin, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BN] key positions
        live = pos < end
        block = tl.load(table_ptr + seq * table_width + pos // block_size, mask=live, other=0)
        rows = (block * block_size + pos % block_size).to(tl.int64)
        k = tl.load(k_ptr + rows[:, None] * stride_kr + kv_head * stride_kh + offs_dk[None, :],
                    mask=live[:, None] & (offs_dk[None, :] < DK), other=0.0)  # [BN, BDK]; FP8 converted below
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale  # [BH, BN]
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + rows[:, None] * stride_vr + kv_head * stride_vh + offs_dv[None, :],
                    mask=live[:, None] & (offs_dv[None, :] < DV), other=0.0).to(q.dtype)  # [BN, BDV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    _finish(acc, m_i, l_i, out_ptr, part_ptr, stat_ptr, seq, offs_h, live_h, split, heads, stride_ob, stride_oh,
            offs_dv, DV, BLOCK_DV, splits, SPLIT)


@triton.jit
def _split_range(length, split, splits, BLOCK_N: tl.constexpr):
    """Key positions [begin, end) of slice `split` of a sequence of `length` keys (whole BLOCK_N steps)."""
    chunk = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
    begin = split * chunk
    return begin, tl.minimum(length, begin + chunk)


@triton.jit
def _finish(acc, m_i, l_i, out_ptr, part_ptr, stat_ptr, seq, offs_h, live_h, split, heads, stride_ob, stride_oh,
            offs_dv, DV: tl.constexpr, BLOCK_DV: tl.constexpr, splits, SPLIT: tl.constexpr):
    """One slice: the output itself, or its unnormalised sum, running max and denominator for `_combine_kernel`."""
    if not SPLIT:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_ob + offs_h[:, None] * stride_oh + offs_dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live_h[:, None] & (offs_dv[None, :] < DV))
    else:
        slot = ((seq * heads + offs_h) * splits + split).to(tl.int64)  # [BH]
        tl.store(part_ptr + slot[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=live_h[:, None])
        tl.store(stat_ptr + slot * 2, m_i, mask=live_h)
        tl.store(stat_ptr + slot * 2 + 1, l_i, mask=live_h)


@triton.jit(do_not_specialize=["splits"])
def _combine_kernel(part_ptr, stat_ptr, out_ptr, heads, stride_ob, stride_oh, splits,
                    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, GDC: tl.constexpr = 0):
    """One (sequence, head): the softmax-weighted sum of its slices' partial outputs."""
    gdc_enter(GDC)
    seq, head = tl.program_id(0), tl.program_id(1)
    slices = tl.arange(0, BLOCK_S)
    live_s = slices < splits
    slot = ((seq * heads + head) * splits + slices).to(tl.int64)
    m = tl.load(stat_ptr + slot * 2, mask=live_s, other=float("-inf"))
    l = tl.load(stat_ptr + slot * 2 + 1, mask=live_s, other=0.0)
    weight = tl.where(l > 0, tl.exp(m - tl.max(m, axis=0)), 0.0)  # an empty slice (m = -inf, l = 0) weighs nothing
    offs_dv = tl.arange(0, BLOCK_DV)
    parts = tl.load(part_ptr + slot[:, None] * BLOCK_DV + offs_dv[None, :], mask=(l > 0)[:, None], other=0.0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.sum(weight * l, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_dv, out.to(out_ptr.dtype.element_ty),
             mask=offs_dv < DV)


MAX_SPLITS = 16


PROGRAMS_PER_MULTIPROCESSOR = 2  # what slices aim at: one leaves HBM idle, more cost merge traffic (measured)


@dataclass(frozen=True)
class DecodeLaunch:
    """How a decode kernel is launched: key rows a loop step, warps, software-pipeline stages, and the programs a
    multiprocessor that `plan_splits` cuts keys for."""
    block_n: int
    num_warps: int
    num_stages: int
    programs_per_multiprocessor: int = PROGRAMS_PER_MULTIPROCESSOR

    def options(self) -> dict:
        return {"BLOCK_N": self.block_n, "num_warps": self.num_warps, "num_stages": self.num_stages}


# The fastest settings of bench/kernels/decode_tune.py's sweep at batch 32-256 and contexts 1,024-4,096 (H100): two stages
# of 64 key rows; the latent kernel's [16, 512] float32 accumulator wants 8 warps. With 64 heads a program the
# latent kernel is bound by its math, not its reads: one program a multiprocessor.
LATENT_LAUNCH = DecodeLaunch(block_n=64, num_warps=8, num_stages=2)
LATENT_MANY_HEADS_LAUNCH = DecodeLaunch(block_n=64, num_warps=8, num_stages=2, programs_per_multiprocessor=1)
GQA_LAUNCH = DecodeLaunch(block_n=64, num_warps=4, num_stages=2)
FP32_LAUNCH = DecodeLaunch(block_n=32, num_warps=4, num_stages=3)  # float32 rows (parity runs): half the key rows
MANY_HEADS = 64


def gqa_launch(dtype: torch.dtype) -> DecodeLaunch:
    """The grouped-query kernel's launch: measured for 16-bit caches; float32's 64-row stages would not fit shared
    memory."""
    return FP32_LAUNCH if dtype == torch.float32 else GQA_LAUNCH


def latent_launch(heads: int, dtype: torch.dtype) -> tuple[int, DecodeLaunch]:
    """The latent kernel's query heads a program and launch. 16 heads (tl.dot's fewest rows; fewer are masked), or
    64 where a layer has that many in 16-bit: DeepSeek-V3's 128 heads read each latent row twice, not eight times,
    and its math, not its reads, bounds it (1.7× faster at batch 64 on an H100, bench/RESULTS.md session 49)."""
    if dtype == torch.float32:
        return 16, FP32_LAUNCH
    return (MANY_HEADS, LATENT_MANY_HEADS_LAUNCH) if heads >= MANY_HEADS else (16, LATENT_LAUNCH)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def plan_splits(programs: int, multiprocessors: int, per_multiprocessor: int = PROGRAMS_PER_MULTIPROCESSOR,
                max_splits: int = MAX_SPLITS) -> int:
    """Slices of every sequence's keys so that `programs` (sequences × head groups) come to at most
    `per_multiprocessor` a multiprocessor: a step of few sequences reads a long context on many multiprocessors,
    not one (pure; from shapes only, so a captured graph serves any context length)."""
    if programs < 1 or multiprocessors < 1 or per_multiprocessor < 1:
        raise ValueError(f"programs {programs}, multiprocessors {multiprocessors} and per_multiprocessor "
                         f"{per_multiprocessor} must be positive")
    return max(1, min(max_splits, per_multiprocessor * multiprocessors // programs))


def default_splits(programs: int, device: torch.device, per_multiprocessor: int = PROGRAMS_PER_MULTIPROCESSOR) -> int:
    """`plan_splits` on `device`; in batch-invariant mode one slice whatever the batch (a sequence's keys summed in
    one order: `afd.kernels.batch_invariant`)."""
    if batch_invariant.enabled():
        return batch_invariant.DECODE_SPLITS
    return plan_splits(programs, _multiprocessors(device), per_multiprocessor)


def _partials(batch: int, heads: int, splits: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Workspaces of the slices: unnormalised outputs [B, H, S, width] and (max, denominator) [B, H, S, 2]."""
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"{splits} slices: the decode kernels cut keys into 1 to {MAX_SPLITS}")
    if splits == 1:
        empty = torch.empty(0, dtype=torch.float32, device=device)
        return empty, empty
    return (torch.empty(batch, heads, splits, width, dtype=torch.float32, device=device),
            torch.empty(batch, heads, splits, 2, dtype=torch.float32, device=device))


def _combine(part, stat, out, splits: int, dv: int, block_dv: int) -> None:
    if splits > 1:
        batch, heads = out.shape[0], out.shape[1]
        _combine_kernel[(batch, heads)](part, stat, out, heads, out.stride(0), out.stride(1), splits, DV=dv,
                                        BLOCK_DV=block_dv, BLOCK_S=triton.next_power_of_2(MAX_SPLITS), num_warps=4,
                                        **launch_options(out.device))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 stays fp32 (parity runs); bf16 ignores it


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, Dk]
    cache_k: torch.Tensor,  # [rows, Hkv, Dk]
    cache_v: torch.Tensor,  # [rows, Hkv, Dv]
    block_table: torch.Tensor,  # [B, W] int32 cache blocks of each sequence
    seq_lens: torch.Tensor,  # [B] int32 keys per sequence, the new one included
    block_size: int,
    scale: float,
    splits: int | None = None,  # slices of each sequence's keys (None: `plan_splits`)
    launch: DecodeLaunch | None = None,  # None: `gqa_launch`
) -> torch.Tensor:
    """Attention of each sequence's one new query over its cached keys: [B, Hq, Dv]."""
    batch, heads, dk = q.shape
    kv_heads, dv = cache_k.shape[1], cache_v.shape[2]
    if cache_k.stride(2) != 1 or cache_v.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("paged_decode_attention needs unit stride on the head dimension")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} key heads evenly")
    group = heads // kv_heads
    launch = launch or gqa_launch(cache_k.dtype)
    splits = splits or default_splits(batch * kv_heads, q.device, launch.programs_per_multiprocessor)
    block_dv = max(16, triton.next_power_of_2(dv))
    out = torch.empty(batch, heads, dv, dtype=q.dtype, device=q.device)
    part, stat = _partials(batch, heads, splits, block_dv, q.device)
    _decode_kernel[(batch, kv_heads, splits)](
        q, cache_k, cache_v, out, part, stat, block_table, seq_lens,
        heads, block_table.shape[1], block_size, group, scale, splits,
        q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), cache_v.stride(0), cache_v.stride(1),
        out.stride(0), out.stride(1),
        DK=dk, DV=dv, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_DK=max(16, triton.next_power_of_2(dk)),
        BLOCK_DV=block_dv, SPLIT=splits > 1, PRECISION=_precision(q.dtype), **launch.options(),
        **launch_options(q.device),
    )
    _combine(part, stat, out, splits, dv, block_dv)
    return out


@triton.jit(do_not_specialize=["splits", "table_width"])
def _latent_decode_kernel(
    q_ptr, r_ptr, cache_ptr, out_ptr, part_ptr, stat_ptr, table_ptr, lens_ptr,
    heads, table_width, block_size, scale, splits,
    stride_qb, stride_qh, stride_rb, stride_rh, stride_cr, stride_ob, stride_oh,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    GDC: tl.constexpr = 0,
):
    gdc_enter(GDC)
    seq, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    begin, end = _split_range(tl.load(lens_ptr + seq), split, splits, BLOCK_N)
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    offs_l, offs_r = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_R)
    live_h = offs_h < heads
    q_rows = q_ptr + seq * stride_qb + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_l[None, :], mask=live_h[:, None] & (offs_l[None, :] < LATENT), other=0.0)  # [BH, BL]
    r_rows = r_ptr + seq * stride_rb + offs_h[:, None] * stride_rh
    q_rot = tl.load(r_rows + offs_r[None, :], mask=live_h[:, None] & (offs_r[None, :] < ROPE), other=0.0)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    for start in range(begin, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BN] key positions
        live = pos < end
        block = tl.load(table_ptr + seq * table_width + pos // block_size, mask=live, other=0)
        rows = cache_ptr + (block * block_size + pos % block_size).to(tl.int64)[:, None] * stride_cr
        # an FP8 cache's rows converted as loaded (static scale 1: afd.models.kv_dtype), the dots in the queries' dtype
        latent = tl.load(rows + offs_l[None, :], mask=live[:, None] & (offs_l[None, :] < LATENT),
                         other=0.0).to(q_lat.dtype)  # [BN, BL]
        rot = tl.load(rows + LATENT + offs_r[None, :], mask=live[:, None] & (offs_r[None, :] < ROPE),
                      other=0.0).to(q_rot.dtype)
        scores = (tl.dot(q_lat, tl.trans(latent), input_precision=PRECISION)
                  + tl.dot(q_rot, tl.trans(rot), input_precision=PRECISION))  # [BH, BN]
        scores = tl.where(live[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=PRECISION)  # [BH, BL]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    _finish(acc, m_i, l_i, out_ptr, part_ptr, stat_ptr, seq, offs_h, live_h, split, heads, stride_ob, stride_oh,
            offs_l, LATENT, BLOCK_L, splits, SPLIT)


def paged_latent_decode_attention(
    q: torch.Tensor,  # [B, H, latent + rope]: queries with the key up-projection absorbed
    cache: torch.Tensor,  # [rows, 1, latent + rope]: one [latent ‖ rotary key] row per token
    latent_dim: int,
    block_table: torch.Tensor,  # [B, W] int32 cache blocks of each sequence
    seq_lens: torch.Tensor,  # [B] int32 keys per sequence, the new one included
    block_size: int,
    scale: float,
    splits: int | None = None,  # slices of each sequence's keys (None: `plan_splits`)
    q_rope: torch.Tensor | None = None,  # [B, H, rope]: the queries' rotary part apart (then q is [B, H, latent])
    launch: DecodeLaunch | None = None,  # None: `latent_launch`
) -> torch.Tensor:
    """MLA decode over a paged latent cache: [B, H, latent], the latent doubling as the value.

    One program serves a block of heads of one sequence (`latent_launch`), so each latent row is
    read once per head block (not once per head as the per-head kernel would). The queries' latent
    and rotary parts may come as two tensors of any row strides (`q_rope`): the absorbed latent
    straight from its batched GEMM, the rotary part where the projection left it, with no concatenation.
    """
    batch, heads = q.shape[:2]
    if q_rope is None:
        q, q_rope = q[..., :latent_dim], q[..., latent_dim:]
    width = latent_dim + q_rope.shape[2]
    if cache.shape[1] != 1 or cache.shape[2] != width or cache.stride(2) != 1 or q.stride(2) != 1 or \
            q_rope.stride(2) != 1 or q.shape[2] != latent_dim or q_rope.shape[:2] != (batch, heads):
        raise ValueError(f"paged_latent_decode_attention needs a [rows, 1, {width}] unit-stride cache and unit-stride "
                         f"queries; got cache {tuple(cache.shape)}, q {tuple(q.shape)}, q_rope {tuple(q_rope.shape)}")
    rope = width - latent_dim
    out = torch.empty(batch, heads, latent_dim, dtype=q.dtype, device=q.device)
    block_h, measured = latent_launch(heads, cache.dtype)
    launch = launch or measured
    head_blocks = triton.cdiv(heads, block_h)
    splits = splits or default_splits(batch * head_blocks, q.device, launch.programs_per_multiprocessor)
    block_l = max(16, triton.next_power_of_2(latent_dim))
    part, stat = _partials(batch, heads, splits, block_l, q.device)
    _latent_decode_kernel[(batch, head_blocks, splits)](
        q, q_rope, cache, out, part, stat, block_table, seq_lens,
        heads, block_table.shape[1], block_size, scale, splits,
        q.stride(0), q.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0), out.stride(0), out.stride(1),
        LATENT=latent_dim, ROPE=rope, BLOCK_H=block_h, BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(rope)), SPLIT=splits > 1, PRECISION=_precision(q.dtype),
        **launch.options(), **launch_options(q.device),
    )
    _combine(part, stat, out, splits, latent_dim, block_l)
    return out
