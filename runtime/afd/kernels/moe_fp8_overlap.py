"""The FP8 MoE kernels' K loops that overlap the block-scale promotion with the tensor cores (`moe_triton`'s
gate_up and down take them with the table keys `LAG` and `K_PAIRS`).

FP8 adds each step's product times its block scales (`acc += dot(a, b) * scale`), so Triton's Hopper pipeliner
waits for every wgmma before its step's multiply-add: the tensor cores idle while the CUDA cores promote. With `LAG`
(FP8, not ONE_DOT) a step issues two dots — gate then up, or `down`'s two column halves — and adds the second's
product one step late, after the next step's first dot: that second wgmma stays in flight while both promotions
run. With `K_PAIRS` (FP8) a loop step covers two K steps and the second's dot(s), issued after the first's
promotion, are promoted in the next loop step: the loop waits for the tensor cores once per two K steps. Same bits
as without either (tests/runtime/test_moe_fp8_lag.py); speed for the tuner to judge. Why these shapes (Triton
3.6/3.7 sources; `bench/moe_fp8_waits.py` shows the waits they compile to):
- triton-lang/triton lib/Dialect/TritonGPU/Transforms/Pipeliner/WGMMAPipeline.cpp (`dotCanBeProperlyAsync`,
  rules from PR #3327, 2024): a wgmma is left in flight across steps only if its product's sole use in the loop is
  the next iteration and there it feeds another wgmma's accumulator or comes after a `warp_group_dot_wait
  {pendings=0}` of that step; otherwise a wait 0 follows the dot. A lone lagged dot thus stays synchronous; a
  second dot after a consumed first one does not (if the kept product is read only after that first dot is
  issued). Splitting one TMA box in two for two dots goes through registers, and such a dot stays synchronous:
  hence LAG without ONE_DOT.
- Warp specialization on Hopper (`tl.range(warp_specialize=True)`) goes to Meta's autoWS pass
  (`add_hopper_warpspec`, PRs #7136 and #8092/#8143 for 3.5); `num_consumer_groups` was the older spelling (PR
  #5622). Meta's fork enabled Hopper autoWS GEMMs end to end only in 2026 (facebookexperimental/triton#1278, which
  forces wait 0 after every wgmma in WS kernels); their blockwise-FP8 WS work (meta-pytorch/tritonbench#1163,
  facebookexperimental/triton#1964) targets Blackwell. Not relied on here.
- Others on Hopper: DeepGEMM (its README) promotes on CUDA cores ("two-level accumulation") in hand-written,
  warp-specialized CUDA kernels that overlap TMA, MMA and promotion;
  vLLM's and SGLang's Triton `w8a8_block_fp8_matmul` add `dot * a_s * b_s` each step as we do.
"""

from __future__ import annotations

import triton
import triton.language as tl

from afd.kernels.moe_tiles import gate_up_rows, row_tile, weight_tile


# LAG (see the module docstring): each step's second dot is added in the next step, after that step's first dot
# (whose wait 0 is the one Triton needs to leave the second in flight). Every column gets the same terms, scaled by
# the same float32 products, added in the same order as without LAG (a column of a dot does not depend on the
# other columns); the first step adds a zero product.


@triton.jit
def gate_up_lagged(x, w, x_scale, w_scale, tile, col, expert, tokens, valid, offs_n, n_ok, hidden, inter,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
                    GATHER: tl.constexpr):
    """(gate, up) float32 accumulators of FP8 gate_up with LAG: the gate dot first (added in its step), the up dot
    second (added one step late); the same bits as the two-dot and the ONE_DOT paths without LAG. (Not with
    ONE_DOT: one box split in two goes through registers, and a dot of those cannot stay in flight.)"""
    h_groups = tl.cdiv(hidden, 128)
    i_groups = inter // 128
    gate_row = expert * 2 * inter + col * BLOCK_N  # rows of w viewed as [E * 2I, H]
    gate_scale_row = (expert * 2 * i_groups + col * BLOCK_N // 128) * h_groups
    gate_scale_rows = (expert * 2 * i_groups + offs_n // 128) * h_groups
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the previous step's up product (none before the first)
    up_a_s = tl.zeros((BLOCK_M, 1), dtype=tl.float32)  # and its scales
    if BLOCK_N <= 128:
        up_w_s = 0.0  # a float32 scalar
    else:
        up_w_s = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        a = gate_up_rows(x, tile, tokens, valid, k0, hidden, BLOCK_M, BLOCK_K, TMA, GATHER)
        g = weight_tile(w, gate_row, k0, n_ok, hidden, BLOCK_N, BLOCK_K, TMA)
        u = weight_tile(w, gate_row + inter, k0, n_ok, hidden, BLOCK_N, BLOCK_K, TMA)
        a_s = tl.load(x_scale + tokens * h_groups + k0 // 128, mask=valid, other=0.0)[:, None]
        if BLOCK_N <= 128:  # one weight block: a scalar each, as without LAG
            g_s = tl.load(w_scale + gate_scale_row + k0 // 128)
            u_s = tl.load(w_scale + gate_scale_row + i_groups * h_groups + k0 // 128)
        else:
            g_s = tl.load(w_scale + gate_scale_rows + k0 // 128, mask=n_ok, other=0.0)[None, :]
            u_s = tl.load(w_scale + gate_scale_rows + i_groups * h_groups + k0 // 128, mask=n_ok, other=0.0)[None, :]
        gate = tl.dot(a, g)
        up_now = tl.dot(a, u)
        acc_g += gate * (a_s * g_s)
        acc_u += up * (up_a_s * up_w_s)
        up, up_a_s, up_w_s = up_now, a_s, u_s
    acc_u += up * (up_a_s * up_w_s)
    return acc_g, acc_u


@triton.jit
def down_lagged(act, w, act_scale, w_scale, a_scale_rows, tile, col, expert, hidden, inter, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """The [BM, BN] float32 accumulator of FP8 down with LAG: two dots over the column block's halves (weight
    tiles of BN/2 rows, each inside one 128-row weight block: BN ≤ 256), the second added one step late."""
    HALF: tl.constexpr = BLOCK_N // 2
    row0 = expert * hidden + col * BLOCK_N  # rows of w viewed as [E * H, I]
    offs_lo = col * BLOCK_N + tl.arange(0, HALF)
    hi_start = col * BLOCK_N + HALF
    i_groups = tl.cdiv(inter, 128)
    lo_scale_row = (expert * tl.cdiv(hidden, 128) + col * BLOCK_N // 128) * i_groups
    hi_scale_row = (expert * tl.cdiv(hidden, 128) + hi_start // 128) * i_groups
    acc_lo = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    hi = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)  # the previous step's second product, and its scales
    hi_s = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        a = row_tile(act, tile * BLOCK_M, k0, inter, BLOCK_M, BLOCK_K, TMA)
        b_lo = weight_tile(w, row0, k0, offs_lo < hidden, inter, HALF, BLOCK_K, TMA)
        b_hi = weight_tile(w, row0 + HALF, k0, offs_lo + HALF < hidden, inter, HALF, BLOCK_K, TMA)
        a_s = tl.load(act_scale + a_scale_rows + k0 // 128)
        lo_s = a_s * tl.load(w_scale + lo_scale_row + k0 // 128)
        hi_now_s = a_s * tl.load(w_scale + hi_scale_row + k0 // 128, mask=hi_start < hidden, other=0.0)
        lo = tl.dot(a, b_lo)
        hi_now = tl.dot(a, b_hi)
        acc_lo += lo * lo_s[:, None]
        acc_hi += hi * hi_s[:, None]
        hi, hi_s = hi_now, hi_now_s
    acc_hi += hi * hi_s[:, None]
    return tl.reshape(tl.permute(tl.join(acc_lo, acc_hi), (0, 2, 1)), (BLOCK_M, BLOCK_N))


# K_PAIRS: a loop step covers two K steps. The first's dot is promoted in the step (after the previous step's second
# product, so terms keep their order), then the second's dot is issued and promoted in the next step: it runs while
# the loop turns and queues the next step's first dot behind it, so a step waits for the tensor cores once per two
# K steps instead of once per K step (the promotion itself is not overlapped). An odd last step pairs with zeros
# (loads past K read zeros, its scales are masked to 0): a zero product added, as the first step's lagged one.


@triton.jit
def gate_up_k_pairs(x, w, x_scale, w_scale, tile, col, expert, tokens, valid, offs_n, n_ok, hidden, inter,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
                     GATHER: tl.constexpr, ONE_DOT: tl.constexpr):
    """(gate, up) float32 accumulators of FP8 gate_up with K_PAIRS, in one dot (ONE_DOT) or two a K step; the same
    bits as without."""
    h_groups = tl.cdiv(hidden, 128)
    i_groups = inter // 128
    gate_row = expert * 2 * inter + col * BLOCK_N  # rows of w viewed as [E * 2I, H] (two dots)
    gate_scale_row = (expert * 2 * i_groups + col * BLOCK_N // 128) * h_groups
    gate_scale_rows = (expert * 2 * i_groups + offs_n // 128) * h_groups
    both = tl.arange(0, 2 * BLOCK_N)  # ONE_DOT: the box's columns, gate's then up's
    both_n = col * BLOCK_N + both % BLOCK_N
    box_scale_rows = (expert * 2 * i_groups + both // BLOCK_N * i_groups + both_n // 128) * h_groups
    is_gate = (both < BLOCK_N)[None, :]
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)  # ONE_DOT's
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the two dots'
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ONE_DOT:
        kept = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)  # the previous step's second product(s)
    else:
        kept_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        kept_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kept_a_s = tl.zeros((BLOCK_M, 1), dtype=tl.float32)  # and their scales
    if ONE_DOT and BLOCK_N != 128:
        kept_b_s = tl.zeros((1, 2 * BLOCK_N), dtype=tl.float32)
    elif BLOCK_N > 128:
        kept_g_s = tl.zeros((1, BLOCK_N), dtype=tl.float32)
        kept_u_s = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    else:
        kept_g_s = 0.0
        kept_u_s = 0.0
    for k0 in range(0, hidden, 2 * BLOCK_K):
        k1 = k0 + BLOCK_K
        a0 = gate_up_rows(x, tile, tokens, valid, k0, hidden, BLOCK_M, BLOCK_K, TMA, GATHER)
        a1 = gate_up_rows(x, tile, tokens, valid, k1, hidden, BLOCK_M, BLOCK_K, TMA, GATHER)
        a_s0 = tl.load(x_scale + tokens * h_groups + k0 // 128, mask=valid, other=0.0)[:, None]
        a_s1 = tl.load(x_scale + tokens * h_groups + k1 // 128, mask=valid & (k1 < hidden), other=0.0)[:, None]
        if ONE_DOT:  # the first dot issued before the kept product is read: only then may the second stay in flight
            b0 = tl.reshape(w.load([2 * expert, col * BLOCK_N, k0]), (2 * BLOCK_N, BLOCK_K)).T
            b1 = tl.reshape(w.load([2 * expert, col * BLOCK_N, k1]), (2 * BLOCK_N, BLOCK_K)).T
            now = tl.dot(a0, b0)
            if BLOCK_N == 128:  # as ONE_DOT without K_PAIRS: the gate's and the up's block scale, a scalar each
                g_s0 = tl.load(w_scale + gate_scale_row + k0 // 128)
                u_s0 = tl.load(w_scale + gate_scale_row + i_groups * h_groups + k0 // 128)
                g_s1 = tl.load(w_scale + gate_scale_row + k1 // 128, mask=k1 < hidden, other=0.0)
                u_s1 = tl.load(w_scale + gate_scale_row + i_groups * h_groups + k1 // 128, mask=k1 < hidden,
                               other=0.0)
                acc += kept * tl.where(is_gate, kept_a_s * kept_g_s, kept_a_s * kept_u_s)
                acc += now * tl.where(is_gate, a_s0 * g_s0, a_s0 * u_s0)
                kept_g_s, kept_u_s = g_s1, u_s1
            else:
                b_s0 = tl.load(w_scale + box_scale_rows + k0 // 128, mask=both_n < inter, other=0.0)[None, :]
                b_s1 = tl.load(w_scale + box_scale_rows + k1 // 128, mask=(both_n < inter) & (k1 < hidden),
                               other=0.0)[None, :]
                acc += kept * (kept_a_s * kept_b_s)
                acc += now * (a_s0 * b_s0)
                kept_b_s = b_s1
            kept = tl.dot(a1, b1)
        else:
            g0 = weight_tile(w, gate_row, k0, n_ok, hidden, BLOCK_N, BLOCK_K, TMA)
            u0 = weight_tile(w, gate_row + inter, k0, n_ok, hidden, BLOCK_N, BLOCK_K, TMA)
            g1 = weight_tile(w, gate_row, k1, n_ok, hidden, BLOCK_N, BLOCK_K, TMA)
            u1 = weight_tile(w, gate_row + inter, k1, n_ok, hidden, BLOCK_N, BLOCK_K, TMA)
            if BLOCK_N <= 128:
                g_s0 = tl.load(w_scale + gate_scale_row + k0 // 128)
                u_s0 = tl.load(w_scale + gate_scale_row + i_groups * h_groups + k0 // 128)
                g_s1 = tl.load(w_scale + gate_scale_row + k1 // 128, mask=k1 < hidden, other=0.0)
                u_s1 = tl.load(w_scale + gate_scale_row + i_groups * h_groups + k1 // 128, mask=k1 < hidden,
                               other=0.0)
            else:
                g_s0 = tl.load(w_scale + gate_scale_rows + k0 // 128, mask=n_ok, other=0.0)[None, :]
                u_s0 = tl.load(w_scale + gate_scale_rows + i_groups * h_groups + k0 // 128, mask=n_ok,
                               other=0.0)[None, :]
                g_s1 = tl.load(w_scale + gate_scale_rows + k1 // 128, mask=n_ok & (k1 < hidden), other=0.0)[None, :]
                u_s1 = tl.load(w_scale + gate_scale_rows + i_groups * h_groups + k1 // 128,
                               mask=n_ok & (k1 < hidden), other=0.0)[None, :]
            gate = tl.dot(a0, g0)
            up = tl.dot(a0, u0)
            acc_g += kept_g * (kept_a_s * kept_g_s)
            acc_g += gate * (a_s0 * g_s0)
            acc_u += kept_u * (kept_a_s * kept_u_s)
            acc_u += up * (a_s0 * u_s0)
            kept_g = tl.dot(a1, g1)
            kept_u = tl.dot(a1, u1)
            kept_g_s, kept_u_s = g_s1, u_s1
        kept_a_s = a_s1
    if ONE_DOT:
        if BLOCK_N == 128:
            acc += kept * tl.where(is_gate, kept_a_s * kept_g_s, kept_a_s * kept_u_s)
        else:
            acc += kept * (kept_a_s * kept_b_s)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    else:
        acc_g += kept_g * (kept_a_s * kept_g_s)
        acc_u += kept_u * (kept_a_s * kept_u_s)
    return acc_g, acc_u


@triton.jit
def down_k_pairs(act, w, act_scale, w_scale, a_scale_rows, tile, col, expert, offs_n, n_ok, hidden, inter,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """The [BM, BN] float32 accumulator of FP8 down with K_PAIRS; the same bits as without."""
    down_row = expert * hidden + col * BLOCK_N  # rows of w viewed as [E * H, I]
    i_groups = tl.cdiv(inter, 128)
    b_scale_rows = (expert * tl.cdiv(hidden, 128) + offs_n // 128) * i_groups
    b_scale_row = (expert * tl.cdiv(hidden, 128) + col * BLOCK_N // 128) * i_groups
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kept = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the previous step's second product, and its scales
    kept_a_s = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if BLOCK_N <= 128:
        kept_b_s = 0.0
    else:
        kept_b_s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, inter, 2 * BLOCK_K):
        k1 = k0 + BLOCK_K
        a0 = row_tile(act, tile * BLOCK_M, k0, inter, BLOCK_M, BLOCK_K, TMA)
        b0 = weight_tile(w, down_row, k0, n_ok, inter, BLOCK_N, BLOCK_K, TMA)
        a1 = row_tile(act, tile * BLOCK_M, k1, inter, BLOCK_M, BLOCK_K, TMA)
        b1 = weight_tile(w, down_row, k1, n_ok, inter, BLOCK_N, BLOCK_K, TMA)
        a_s0 = tl.load(act_scale + a_scale_rows + k0 // 128)
        a_s1 = tl.load(act_scale + a_scale_rows + k1 // 128, mask=k1 < inter, other=0.0)
        now = tl.dot(a0, b0)  # issued before the kept product is read: only then may the second dot stay in flight
        if BLOCK_N <= 128:  # as without K_PAIRS: one scale a step
            b_s0 = tl.load(w_scale + b_scale_row + k0 // 128)
            b_s1 = tl.load(w_scale + b_scale_row + k1 // 128, mask=k1 < inter, other=0.0)
            acc += kept * (kept_a_s * kept_b_s)[:, None]
            acc += now * (a_s0 * b_s0)[:, None]
        else:
            b_s0 = tl.load(w_scale + b_scale_rows + k0 // 128, mask=n_ok, other=0.0)
            b_s1 = tl.load(w_scale + b_scale_rows + k1 // 128, mask=n_ok & (k1 < inter), other=0.0)
            acc += kept * (kept_a_s[:, None] * kept_b_s[None, :])
            acc += now * (a_s0[:, None] * b_s0[None, :])
        kept = tl.dot(a1, b1)
        kept_a_s, kept_b_s = a_s1, b_s1
    if BLOCK_N <= 128:
        acc += kept * (kept_a_s * kept_b_s)[:, None]
    else:
        acc += kept * (kept_a_s[:, None] * kept_b_s[None, :])
    return acc
