"""Paged decode attention in Triton: one new query per sequence, keys read through block tables.

Graph-friendly: every shape is (batch, heads, dims); each sequence's length is read on
the device, so one captured graph serves any mix of context lengths up to the table width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, lens_ptr,
    table_width, block_size, group, scale,
    stride_qb, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_ob, stride_oh,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // group
    length = tl.load(lens_ptr + seq)
    offs_dk, offs_dv = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + offs_dk, mask=offs_dk < DK, other=0.0).to(tl.float32)
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    for start in range(0, length, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BN] key positions
        live = pos < length
        block = tl.load(table_ptr + seq * table_width + pos // block_size, mask=live, other=0)
        rows = (block * block_size + pos % block_size).to(tl.int64)
        k = tl.load(k_ptr + rows[:, None] * stride_kr + kv_head * stride_kh + offs_dk[None, :],
                    mask=live[:, None] & (offs_dk[None, :] < DK), other=0.0).to(tl.float32)  # [BN, DK]
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(live, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + rows[:, None] * stride_vr + kv_head * stride_vh + offs_dv[None, :],
                    mask=live[:, None] & (offs_dv[None, :] < DV), other=0.0).to(tl.float32)  # [BN, DV]
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_dv, out.to(out_ptr.dtype.element_ty), mask=offs_dv < DV)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, Dk]
    cache_k: torch.Tensor,  # [rows, Hkv, Dk]
    cache_v: torch.Tensor,  # [rows, Hkv, Dv]
    block_table: torch.Tensor,  # [B, W] int32 cache blocks of each sequence
    seq_lens: torch.Tensor,  # [B] int32 keys per sequence, the new one included
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Attention of each sequence's one new query over its cached keys: [B, Hq, Dv]."""
    batch, heads, dk = q.shape
    kv_heads, dv = cache_k.shape[1], cache_v.shape[2]
    out = torch.empty(batch, heads, dv, dtype=q.dtype, device=q.device)
    if cache_k.stride(2) != 1 or cache_v.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("paged_decode_attention needs unit stride on the head dimension")
    _decode_kernel[(batch, heads)](
        q, cache_k, cache_v, out, block_table, seq_lens,
        block_table.shape[1], block_size, heads // kv_heads, scale,
        q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), cache_v.stride(0), cache_v.stride(1),
        out.stride(0), out.stride(1),
        DK=dk, DV=dv, BLOCK_DK=triton.next_power_of_2(dk), BLOCK_DV=triton.next_power_of_2(dv), BLOCK_N=32,
        num_warps=4,
    )
    return out


@triton.jit
def _latent_decode_kernel(
    q_ptr, cache_ptr, out_ptr, table_ptr, lens_ptr,
    heads, table_width, block_size, scale,
    stride_qb, stride_qh, stride_cr, stride_ob, stride_oh,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    seq, head_block = tl.program_id(0), tl.program_id(1)
    length = tl.load(lens_ptr + seq)
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    offs_l, offs_r = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_R)
    live_h = offs_h < heads
    q_rows = q_ptr + seq * stride_qb + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_l[None, :], mask=live_h[:, None] & (offs_l[None, :] < LATENT), other=0.0)  # [BH, BL]
    q_rot = tl.load(q_rows + LATENT + offs_r[None, :], mask=live_h[:, None] & (offs_r[None, :] < ROPE), other=0.0)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    for start in range(0, length, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BN] key positions
        live = pos < length
        block = tl.load(table_ptr + seq * table_width + pos // block_size, mask=live, other=0)
        rows = cache_ptr + (block * block_size + pos % block_size).to(tl.int64)[:, None] * stride_cr
        latent = tl.load(rows + offs_l[None, :], mask=live[:, None] & (offs_l[None, :] < LATENT), other=0.0)  # [BN, BL]
        rot = tl.load(rows + LATENT + offs_r[None, :], mask=live[:, None] & (offs_r[None, :] < ROPE), other=0.0)
        scores = (tl.dot(q_lat, tl.trans(latent), input_precision=PRECISION)
                  + tl.dot(q_rot, tl.trans(rot), input_precision=PRECISION))  # [BH, BN]
        scores = tl.where(live[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=PRECISION)  # [BH, BL]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_ob + offs_h[:, None] * stride_oh + offs_l[None, :], out.to(out_ptr.dtype.element_ty),
             mask=live_h[:, None] & (offs_l[None, :] < LATENT))


def paged_latent_decode_attention(
    q: torch.Tensor,  # [B, H, latent + rope]: queries with the key up-projection absorbed
    cache: torch.Tensor,  # [rows, 1, latent + rope]: one [latent ‖ rotary key] row per token
    latent_dim: int,
    block_table: torch.Tensor,  # [B, W] int32 cache blocks of each sequence
    seq_lens: torch.Tensor,  # [B] int32 keys per sequence, the new one included
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """MLA decode over a paged latent cache: [B, H, latent], the latent doubling as the value.

    One program serves a block of heads of one sequence, so each latent row is read once
    per head block (not once per head as the per-head kernel would).
    """
    batch, heads, width = q.shape
    if cache.shape[1] != 1 or cache.shape[2] != width or cache.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError(f"paged_latent_decode_attention needs a [rows, 1, {width}] unit-stride cache, got {tuple(cache.shape)}")
    rope = width - latent_dim
    out = torch.empty(batch, heads, latent_dim, dtype=q.dtype, device=q.device)
    block_h = 16  # tl.dot needs 16 rows; fewer heads are masked
    _latent_decode_kernel[(batch, triton.cdiv(heads, block_h))](
        q, cache, out, block_table, seq_lens,
        heads, block_table.shape[1], block_size, scale,
        q.stride(0), q.stride(1), cache.stride(0), out.stride(0), out.stride(1),
        LATENT=latent_dim, ROPE=rope, BLOCK_H=block_h, BLOCK_L=max(16, triton.next_power_of_2(latent_dim)),
        BLOCK_R=max(16, triton.next_power_of_2(rope)), BLOCK_N=32, num_warps=4,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32 (parity runs); bf16 ignores it
    )
    return out
