"""DeepSeek-V3.2's sparse MLA in Triton: index scores, top-k, latent attention over the chosen rows only.

Decode is three launches a layer, all shaped by (batch, table width) alone, so a captured decode graph serves any
mix of context lengths: `_index_scores_kernel` scores every cached position of each sequence (one program per
sequence and BLOCK_N positions: the index queries of all index heads against BLOCK_N index keys, on tensor cores;
positions past the sequence score -inf); `torch.topk` keeps the `index_topk` best positions; and
`_sparse_latent_kernel` is `afd.kernels.decode_attention`'s latent kernel reading those positions' rows instead of
every row (a chosen position past the sequence, where it holds fewer keys than `index_topk`, is skipped). The
indexer reads index_head_dim values a token (128: a quarter of MLA's 576); the attention reads index_topk rows
whatever the context. A prompt (or chunk) is the same three steps with every query token a sequence of its own:
`_prompt_index_scores_kernel` scores query tiles against key tiles (the head sum fused, causal), and the latent
kernel reads each token's chosen rows, absorbed as decode is (so is DeepSeek's sparse prefill: 576-wide keys rather
than 192, but index_topk of them a query rather than every earlier one). The plain-torch reference is
`afd.models.dsa`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd.kernels.decode_attention import (_combine, _finish, _partials, _precision, _split_range, default_splits,
                                          latent_launch)
from afd.kernels.pdl import gdc_enter, launch_options

INDEX_BLOCK_N = 64  # positions an index-score program scores


# do_not_specialize: what varies with the step's table width or a prompt's length (Triton would compile apart values of
# 1 and multiples of 16: a JIT compile in the middle of serving, `afd.kernels.decode_attention`)
@triton.jit(do_not_specialize=["table_width", "stride_ob"])
def _index_scores_kernel(
    q_ptr, w_ptr, k_ptr, out_ptr, table_ptr, lens_ptr,
    table_width, block_size, scale,
    stride_qb, stride_qh, stride_wb, stride_kr, stride_ob,
    HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, GDC: tl.constexpr = 0,
):
    """One program: BLOCK_N positions of one sequence, Σ_h w_h · relu(scale · q_h · k) each (-inf past its end)."""
    gdc_enter(GDC)
    seq, chunk = tl.program_id(0), tl.program_id(1)
    length = tl.load(lens_ptr + seq)
    pos = chunk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    live = pos < length
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    live_h, live_d = offs_h < HEADS, offs_d < DIM
    q = tl.load(q_ptr + seq * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=live_h[:, None] & live_d[None, :], other=0.0)  # [BH, BD]
    w = tl.load(w_ptr + seq * stride_wb + offs_h, mask=live_h, other=0.0)  # [BH] float32
    block = tl.load(table_ptr + seq * table_width + pos // block_size, mask=live, other=0)
    rows = (block * block_size + pos % block_size).to(tl.int64)
    k = tl.load(k_ptr + rows[:, None] * stride_kr + offs_d[None, :], mask=live[:, None] & live_d[None, :],
                other=0.0)  # [BN, BD]
    dots = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [BH, BN]
    scores = tl.sum(tl.maximum(dots * scale, 0.0) * w[:, None], axis=0)  # [BN]
    tl.store(out_ptr + seq * stride_ob + pos, tl.where(live, scores, float("-inf")),
             mask=pos < table_width * block_size)


def paged_index_scores(
    index_q: torch.Tensor,  # [B, index heads, index dim]
    index_w: torch.Tensor,  # [B, index heads] float32 head weights
    cache_index: torch.Tensor,  # [rows, index dim] index keys
    scale: float,
    block_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32 keys per sequence, the new one included
    block_size: int,
) -> torch.Tensor:
    """Index scores of every position of each sequence's blocks: [B, W * block_size] float32, -inf past its end."""
    batch, heads, dim = index_q.shape
    if cache_index.stride(1) != 1 or index_q.stride(2) != 1 or cache_index.shape[1] != dim:
        raise ValueError(f"paged_index_scores needs unit-stride [rows, {dim}] index keys and queries; got keys "
                         f"{tuple(cache_index.shape)}, queries {tuple(index_q.shape)}")
    width = block_table.shape[1] * block_size
    out = torch.empty(batch, width, dtype=torch.float32, device=index_q.device)
    index_w = index_w.float()
    _index_scores_kernel[(batch, triton.cdiv(width, INDEX_BLOCK_N))](
        index_q, index_w, cache_index, out, block_table, seq_lens, block_table.shape[1], block_size, scale,
        index_q.stride(0), index_q.stride(1), index_w.stride(0), cache_index.stride(0), out.stride(0),
        HEADS=heads, DIM=dim, BLOCK_H=max(16, triton.next_power_of_2(heads)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=INDEX_BLOCK_N, PRECISION=_precision(index_q.dtype),
        num_warps=4, **launch_options(index_q.device),
    )
    return out


@triton.jit(do_not_specialize=["splits", "count", "stride_ib", "stride_tb"])
def _sparse_latent_kernel(
    q_ptr, r_ptr, cache_ptr, out_ptr, part_ptr, stat_ptr, table_ptr, lens_ptr, idx_ptr,
    heads, block_size, scale, splits, count,
    stride_qb, stride_qh, stride_rb, stride_rh, stride_cr, stride_ob, stride_oh, stride_ib, stride_tb,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    GDC: tl.constexpr = 0,
):
    """One program: a block of heads of one sequence over one of `splits` slices of its chosen positions (ascending:
    the first min(count, length) are its own, the rest past its end)."""
    gdc_enter(GDC)
    seq, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lens_ptr + seq)
    begin, end = _split_range(tl.minimum(count, length), split, splits, BLOCK_N)
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    offs_l, offs_r = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_R)
    live_h = offs_h < heads
    q_rows = q_ptr + seq * stride_qb + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_l[None, :], mask=live_h[:, None] & (offs_l[None, :] < LATENT), other=0.0)
    r_rows = r_ptr + seq * stride_rb + offs_h[:, None] * stride_rh
    q_rot = tl.load(r_rows + offs_r[None, :], mask=live_h[:, None] & (offs_r[None, :] < ROPE), other=0.0)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    for start in range(begin, end, BLOCK_N):
        slot = start + tl.arange(0, BLOCK_N)  # [BN] places in the chosen list
        pos = tl.load(idx_ptr + seq * stride_ib + slot, mask=slot < end, other=0)
        live = (slot < end) & (pos < length) & (pos >= 0)
        block = tl.load(table_ptr + seq * stride_tb + pos // block_size, mask=live, other=0)
        rows = cache_ptr + (block * block_size + pos % block_size).to(tl.int64)[:, None] * stride_cr
        latent = tl.load(rows + offs_l[None, :], mask=live[:, None] & (offs_l[None, :] < LATENT), other=0.0)
        rot = tl.load(rows + LATENT + offs_r[None, :], mask=live[:, None] & (offs_r[None, :] < ROPE), other=0.0)
        scores = (tl.dot(q_lat, tl.trans(latent), input_precision=PRECISION)
                  + tl.dot(q_rot, tl.trans(rot), input_precision=PRECISION))  # [BH, BN]
        scores = tl.where(live[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a step with no live row (chosen past the end)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    _finish(acc, m_i, l_i, out_ptr, part_ptr, stat_ptr, seq, offs_h, live_h, split, heads, stride_ob, stride_oh,
            offs_l, LATENT, BLOCK_L, splits, SPLIT)


def sparse_latent_attention(
    q: torch.Tensor,  # [B, H, latent]: queries with the key up-projection absorbed
    q_rope: torch.Tensor,  # [B, H, rope]
    cache: torch.Tensor,  # [rows, 1, latent + rope]
    latent_dim: int,
    positions: torch.Tensor,  # [B, K] chosen positions of each sequence, ascending (those past its end come last)
    block_table: torch.Tensor,  # [B, W] int32 (its rows may be one row repeated: stride 0)
    seq_lens: torch.Tensor,  # [B] int32
    block_size: int,
    scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """MLA decode over each sequence's chosen positions only: [B, H, latent]. Slices cut the chosen positions it
    holds (min(K, length)), in ascending order: a sequence's result does not depend on the table's width, and
    while it holds no more than K keys its rows are read in the dense latent kernel's order."""
    batch, heads = q.shape[:2]
    width = latent_dim + q_rope.shape[2]
    if cache.shape[1] != 1 or cache.shape[2] != width or cache.stride(2) != 1 or q.stride(2) != 1 or \
            q_rope.stride(2) != 1 or positions.stride(1) != 1 or block_table.stride(1) != 1:
        raise ValueError(f"sparse_latent_attention needs a [rows, 1, {width}] unit-stride cache, unit-stride queries "
                         f"and positions; got cache {tuple(cache.shape)}, q {tuple(q.shape)}")
    rope = width - latent_dim
    out = torch.empty(batch, heads, latent_dim, dtype=q.dtype, device=q.device)
    block_h, launch = latent_launch(heads, cache.dtype)
    head_blocks = triton.cdiv(heads, block_h)
    splits = splits or default_splits(batch * head_blocks, q.device, launch.programs_per_multiprocessor)
    block_l = max(16, triton.next_power_of_2(latent_dim))
    part, stat = _partials(batch, heads, splits, block_l, q.device)
    _sparse_latent_kernel[(batch, head_blocks, splits)](
        q, q_rope, cache, out, part, stat, block_table, seq_lens, positions,
        heads, block_size, scale, splits, positions.shape[1],
        q.stride(0), q.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0), out.stride(0), out.stride(1),
        positions.stride(0), block_table.stride(0),
        LATENT=latent_dim, ROPE=rope, BLOCK_H=block_h, BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(rope)), SPLIT=splits > 1, PRECISION=_precision(q.dtype),
        **launch.options(), **launch_options(q.device),
    )
    _combine(part, stat, out, splits, latent_dim, block_l)
    return out


def chosen_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The `topk` best-scored positions of each row of `scores` [R, L] (all of them where L is no more), ascending:
    [R, min(topk, L)] int32. Positions scored -inf (past a sequence's end) are chosen last, so they come last."""
    chosen = scores.topk(min(topk, scores.shape[1]), dim=-1, sorted=False).indices
    return chosen.sort(dim=-1).values.to(torch.int32)


def sparse_latent_decode(q: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, latent_dim: int,
                         index_q: torch.Tensor, index_w: torch.Tensor, cache_index: torch.Tensor, index_scale: float,
                         topk: int, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                         scale: float, splits: int | None = None) -> torch.Tensor:
    """DeepSeek-V3.2's decode step for one query per sequence: index scores, the `topk` best positions, latent
    attention over them: [B, H, latent]. Capturable: no host sync, shapes from the block table's width only."""
    scores = paged_index_scores(index_q, index_w, cache_index, index_scale, block_table, seq_lens, block_size)
    positions = chosen_positions(scores, topk)
    return sparse_latent_attention(q, q_rope, cache, latent_dim, positions, block_table, seq_lens, block_size,
                                   scale, splits)


PROMPT_BLOCK_M, PROMPT_BLOCK_N = 32, 64  # query and key tiles of a prompt's index scores


@triton.jit(do_not_specialize=["count", "length", "stride_ot"])
def _prompt_index_scores_kernel(
    q_ptr, w_ptr, k_ptr, out_ptr, count, length, scale,
    stride_qt, stride_qh, stride_wt, stride_kr, stride_ot,
    HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, GDC: tl.constexpr = 0,
):
    """One program: BLOCK_M of a prompt's last `count` query tokens against BLOCK_N of its `length` keys,
    Σ_h w_h · relu(scale · q_h · k), -inf where the key follows the query (a tile wholly after it skips the math)."""
    gdc_enter(GDC)
    tile_m, tile_n = tl.program_id(0), tl.program_id(1)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] query tokens
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] key positions
    live_m, live_n = rows < count, cols < length
    offs_d = tl.arange(0, BLOCK_D)
    live_d = offs_d < DIM
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if tile_n * BLOCK_N <= length - count + tile_m * BLOCK_M + BLOCK_M - 1:  # the tile's last query sees a key of it
        k = tl.load(k_ptr + cols[:, None] * stride_kr + offs_d[None, :], mask=live_n[:, None] & live_d[None, :],
                    other=0.0)  # [BN, BD]
        for head in range(HEADS):
            q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                        mask=live_m[:, None] & live_d[None, :], other=0.0)  # [BM, BD]
            w = tl.load(w_ptr + rows * stride_wt + head, mask=live_m, other=0.0)  # [BM] float32
            dots = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [BM, BN]
            acc += w[:, None] * tl.maximum(dots * scale, 0.0)
    allowed = live_n[None, :] & (cols[None, :] <= (length - count + rows)[:, None])
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], tl.where(allowed, acc, float("-inf")),
             mask=live_m[:, None] & live_n[None, :])


def prompt_index_scores(index_q: torch.Tensor, index_w: torch.Tensor, index_keys: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Index scores of one prompt's (or chunk's) last `n` query tokens over its `L` keys: [n, L] float32, -inf
    where causality forbids. index_q [n, heads, dim], index_w [n, heads], index_keys [L, dim]."""
    count, heads, dim = index_q.shape
    length = index_keys.shape[0]
    if index_q.stride(2) != 1 or index_keys.stride(1) != 1 or count > length:
        raise ValueError(f"prompt_index_scores needs unit-stride queries and keys and no more queries than keys; "
                         f"got queries {tuple(index_q.shape)}, keys {tuple(index_keys.shape)}")
    out = torch.empty(count, length, dtype=torch.float32, device=index_q.device)
    index_w = index_w.float()
    grid = (triton.cdiv(count, PROMPT_BLOCK_M), triton.cdiv(length, PROMPT_BLOCK_N))
    _prompt_index_scores_kernel[grid](
        index_q, index_w, index_keys, out, count, length, scale,
        index_q.stride(0), index_q.stride(1), index_w.stride(0), index_keys.stride(0), out.stride(0),
        HEADS=heads, DIM=dim, BLOCK_M=PROMPT_BLOCK_M, BLOCK_N=PROMPT_BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), PRECISION=_precision(index_q.dtype), num_warps=4,
        **launch_options(index_q.device),
    )
    return out


def sparse_latent_prefill(q: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, latent_dim: int,
                          index_q: torch.Tensor, index_w: torch.Tensor, index_keys: torch.Tensor, key_rows: torch.Tensor,
                          index_scale: float, topk: int, scale: float) -> torch.Tensor:
    """One prompt's (or chunk's) last `n` query tokens over their chosen keys, absorbed: [n, H, latent]. `key_rows`
    [L]: the cache row of each of its keys; `index_keys` [L, dim]: theirs, gathered."""
    count, length = q.shape[0], key_rows.shape[0]
    scores = prompt_index_scores(index_q, index_w, index_keys, index_scale)
    positions = chosen_positions(scores, topk)  # [n, K]
    table = key_rows.to(torch.int32).view(1, length).expand(count, length)  # blocks of one row: the rows themselves
    lengths = torch.arange(length - count + 1, length + 1, dtype=torch.int32, device=q.device)  # causal
    return sparse_latent_attention(q, q_rope, cache, latent_dim, positions, table, lengths, 1, scale)
