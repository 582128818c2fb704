"""gate_up's HALVES variant (a table entry's `HALVES`, read by `moe_triton.gate_up_kernel`): a program's block
of BLOCK_N act columns in two passes over K, each pass multiplying the A tile by ONE weight tile of BLOCK_N columns
that holds half the block's gate columns beside the same half's up columns.

Why: the two-dot form keeps a gate and an up accumulator (2 × BM×BN float32) through the K loop, and FP8 adds
each step's product (one more BM×BN: the block scales are applied before it is added), 192 registers a thread at
BLOCK_M 128 / 8 warps, which ptxas lifts to 255 and spills; one such program fills a Hopper multiprocessor's
register file, so its two warpgroups wait on each other's promotion. A pass here holds one BM×BN accumulator and
the step's product (128 a thread at BLOCK_M 64 / 4 warps, as `down`'s) plus, in the second pass, the first half's
act (BM×BN/2): several programs share a multiprocessor and overlap one's promotion with another's dots. The A tile
is read twice (once a pass; the second from L2).

FP8 needs BLOCK_N 128 (a half of 64 columns lies in one 128-row weight block: one gate and one up scale a step);
both halves are quantized with one scale per row (the act group of 128 columns), as the two-dot form does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from afd.kernels.fp8_gemm import FP8_MAX, quant_scaled
from afd.kernels.moe_tiles import gate_up_rows

E4M3_MAX = tl.constexpr(FP8_MAX)  # a kernel reads only constexpr globals


@triton.jit
def _pair_tile(w, expert, first, k0, inter, hidden, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               TMA: tl.constexpr):
    """[BK, BN]: the gate rows of act columns first..first+BN/2 of `expert`, then the same columns' up rows, at
    inputs k0..; through a 3-D descriptor over [2E, I, H] (box [2, BN/2, BK]) or a masked pointer load (w viewed
    as [E·2I, H]). Columns past `inter` read zeros (TMA) or are masked; they are never stored."""
    HALF: tl.constexpr = BLOCK_N // 2
    if TMA:
        tile = tl.reshape(w.load([2 * expert, first, k0]), (BLOCK_N, BLOCK_K)).T
    else:
        j = tl.arange(0, BLOCK_N)
        n = first + j % HALF  # the act column of each tile column
        rows = expert * 2 * inter + j // HALF * inter + n
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w + rows[None, :].to(tl.int64) * hidden + offs_k[:, None],
                       mask=(offs_k[:, None] < hidden) & (n < inter)[None, :], other=0.0)
    return tile


@triton.jit
def _half_act(x, w, x_scale, w_scale, expert, tile, first, tokens, valid, hidden, inter, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr, GATHER: tl.constexpr,
              FP8: tl.constexpr):
    """[BM, BN/2] float32 SiLU(A @ gate) * (A @ up) for act columns first..first+BN/2: one dot a step."""
    HALF: tl.constexpr = BLOCK_N // 2
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:
        h_groups = tl.cdiv(hidden, 128)
        i_groups = inter // 128
        gate_scale_row = (expert * 2 * i_groups + first // 128) * h_groups  # the half lies in one weight block
        up_scale_row = gate_scale_row + i_groups * h_groups
        is_gate = (tl.arange(0, BLOCK_N) < HALF)[None, :]
    for k0 in range(0, hidden, BLOCK_K):
        a = gate_up_rows(x, tile, tokens, valid, k0, hidden, BLOCK_M, BLOCK_K, TMA, GATHER)
        b = _pair_tile(w, expert, first, k0, inter, hidden, BLOCK_N, BLOCK_K, TMA)
        if FP8:
            a_s = tl.load(x_scale + tokens * h_groups + k0 // 128, mask=valid, other=0.0)[:, None]
            g_s = tl.load(w_scale + gate_scale_row + k0 // 128)
            u_s = tl.load(w_scale + up_scale_row + k0 // 128)
            acc += tl.dot(a, b) * tl.where(is_gate, a_s * g_s, a_s * u_s)
        else:
            acc = tl.dot(a, b, acc)
    gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def gate_up_halves_job(x, w, act_ptr, pairs_ptr, tile_expert_ptr, x_scale, w_scale, act_scale, tile, col, num_pairs,
                       slots, hidden, inter, layout_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, TMA: tl.constexpr, GATHER: tl.constexpr, FP8: tl.constexpr):
    """act[tile's rows, col's block] = SiLU(A @ gate) * (A @ up), the block's two halves one after the other
    (`moe_triton._gate_up_job`'s contract, FP8 included: e4m3 act, `act_scale` [rows, I/128])."""
    HALF: tl.constexpr = BLOCK_N // 2
    expert = tl.load(tile_expert_ptr + tile * BLOCK_M // layout_m)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows)  # [BM] pair index, num_pairs = padding
    valid = pairs < num_pairs
    tokens = (pairs // slots).to(tl.int64)
    row_ptrs = act_ptr + rows[:, None].to(tl.int64) * inter
    offs_0 = col * BLOCK_N + tl.arange(0, HALF)
    offs_1 = offs_0 + HALF
    act_0 = _half_act(x, w, x_scale, w_scale, expert, tile, col * BLOCK_N, tokens, valid, hidden, inter, BLOCK_M,
                      BLOCK_N, BLOCK_K, TMA, GATHER, FP8)
    if not FP8:  # stored at once: nothing of the first half lives through the second pass
        tl.store(row_ptrs + offs_0[None, :], act_0.to(act_ptr.dtype.element_ty), mask=(offs_0 < inter)[None, :])
    act_1 = _half_act(x, w, x_scale, w_scale, expert, tile, col * BLOCK_N + HALF, tokens, valid, hidden, inter,
                      BLOCK_M, BLOCK_N, BLOCK_K, TMA, GATHER, FP8)
    if FP8:  # BLOCK_N 128: both halves are the row's one act group, quantized with one scale
        amax = tl.maximum(tl.max(tl.abs(act_0), axis=1), tl.max(tl.abs(act_1), axis=1))
        scale = tl.maximum(amax / E4M3_MAX, 1e-10 / E4M3_MAX)
        tl.store(row_ptrs + offs_0[None, :], quant_scaled(act_0, scale[:, None], E4M3_MAX))
        tl.store(row_ptrs + offs_1[None, :], quant_scaled(act_1, scale[:, None], E4M3_MAX))
        tl.store(act_scale + rows.to(tl.int64) * (inter // 128) + col, scale)
    else:
        tl.store(row_ptrs + offs_1[None, :], act_1.to(act_ptr.dtype.element_ty), mask=(offs_1 < inter)[None, :])
