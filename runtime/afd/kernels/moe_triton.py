"""Fused MoE in Triton, after the alignment (`moe_align`): two GEMM kernels, then a sum over each token's pairs
(`moe_rows.sum_slots`).

`moe_align.align` first lays the (token, slot) pairs out (pair p = token·(k+S) + slot,
the S shared experts as the last slots) so that every tile of `block_m` rows belongs
to one expert.

`gate_up` gathers token rows straight from `x`, multiplies by the expert's gate and up
weights and writes SiLU(gate)·up; `down` multiplies by the down weights, scales by
the routing weight and writes each pair's row at its pair index (token order), so
the final sum over a token's pairs (float32, slot order) is deterministic. No host
synchronisation anywhere: grid sizes come from the worst case and unused tiles exit.

Each GEMM kernel has its own tile height (a divisor of the layout's `block_m`, so a
tile still has one expert; tiles that are all padding exit), its own program order
(`GROUP_M` tiles sweep the columns together, keeping their A rows in L2) and may load
its weights — and `down` its A rows — through TMA descriptors on Hopper. With `GATHER`
a copy kernel (`moe_rows.gather_rows`) first writes `gate_up`'s A rows in layout order into a caller's
buffer (`x_rows`, zeros for padding), which `gate_up` then reads contiguously: through TMA too.
With `ONE_DOT` (TMA only) `gate_up` takes a column block's gate and up rows in one 3-D TMA
box and multiplies them in one dot twice as wide, splitting the two halves after the loop. With `HALVES`
(`moe_gate_up_halves`) a column block's act is made in two passes, each one dot over half its gate columns beside
the same half's up columns (one accumulator, not two). A table entry's settings are checked and the grid sized
in `moe_launch`; the tile loaders and the program order are in `moe_tiles`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from afd.kernels.fp8_gemm import FP8, FP8_MAX, GROUP, quant_groups
from afd.kernels.moe_align import Layout
from afd.kernels.moe_gate_up_halves import gate_up_halves_job
from afd.kernels.moe_launch import TensorDescriptor, kernel_settings, launch, operand, tma_supported
from afd.kernels.moe_rows import gather_rows
from afd.kernels.moe_tiles import gate_up_rows, row_tile, tile_and_col, weight_tile
from afd.kernels.pdl import gdc_enter

E4M3_MAX = tl.constexpr(FP8_MAX)  # a kernel reads only constexpr globals


@triton.jit
def _gate_up_job(x, w, act_ptr, pairs_ptr, tile_expert_ptr, x_scale, w_scale, act_scale, tile, col, num_pairs, slots,
                 hidden, inter, layout_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 TMA: tl.constexpr, GATHER: tl.constexpr, ONE_DOT: tl.constexpr, FP8: tl.constexpr):
    """act[tile's rows, col's block] = SiLU(A @ gate) * (A @ up) for one tile and column block. With ONE_DOT,
    `w` is a 3-D descriptor over [2E, I, H] and one TMA box brings the gate and up blocks of the column block
    ([2, BN, BK]) for one dot of width 2·BN (the A tile is read once per step); else two loads and two dots.
    With FP8, A and the weights are e4m3: each step's product is added times the A rows' group scales
    (`x_scale` [T, H/128], by token) and the weight blocks' (`w_scale` [E, 2I/128, H/128]), and act is written
    in e4m3 with one scale per row per 128 columns (`act_scale` [rows, I/128])."""
    expert = tl.load(tile_expert_ptr + tile * BLOCK_M // layout_m)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    pairs = tl.load(pairs_ptr + rows)  # [BM] pair index, num_pairs = padding
    valid = pairs < num_pairs
    tokens = (pairs // slots).to(tl.int64)
    h_groups = tl.cdiv(hidden, 128)
    i_groups = inter // 128  # FP8 needs I % 128 == 0 (the gate's scale rows, then the up's)
    if ONE_DOT:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        if FP8:  # each column's weight scale row: gate's then up's, as the box holds them
            both = tl.arange(0, 2 * BLOCK_N)
            both_n = col * BLOCK_N + both % BLOCK_N
            b_scale_rows = (expert * 2 * i_groups + both // BLOCK_N * i_groups + both_n // 128) * h_groups
            gate_scale_row = (expert * 2 * i_groups + col * BLOCK_N // 128) * h_groups  # BLOCK_N == 128: one block
            is_gate = (both < BLOCK_N)[None, :]
        for k0 in range(0, hidden, BLOCK_K):
            a = gate_up_rows(x, tile, tokens, valid, k0, hidden, BLOCK_M, BLOCK_K, TMA, GATHER)
            b = tl.reshape(w.load([2 * expert, col * BLOCK_N, k0]), (2 * BLOCK_N, BLOCK_K)).T  # [BK, gate | up]
            if FP8:
                a_s = tl.load(x_scale + tokens * h_groups + k0 // 128, mask=valid, other=0.0)[:, None]
                if BLOCK_N == 128:  # two scalars a step (the gate's block, the up's), not one load per column
                    g_s = tl.load(w_scale + gate_scale_row + k0 // 128)
                    u_s = tl.load(w_scale + gate_scale_row + i_groups * h_groups + k0 // 128)
                    acc += tl.dot(a, b) * tl.where(is_gate, a_s * g_s, a_s * u_s)
                else:
                    b_s = tl.load(w_scale + b_scale_rows + k0 // 128, mask=both_n < inter, other=0.0)
                    acc += tl.dot(a, b) * (a_s * b_s[None, :])
            else:
                acc = tl.dot(a, b, acc)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    else:
        gate_row = expert * 2 * inter + col * BLOCK_N  # rows of w viewed as [E * 2I, H]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        gate_scale_rows = (expert * 2 * i_groups + offs_n // 128) * h_groups
        gate_scale_row = (expert * 2 * i_groups + col * BLOCK_N // 128) * h_groups
        for k0 in range(0, hidden, BLOCK_K):
            a = gate_up_rows(x, tile, tokens, valid, k0, hidden, BLOCK_M, BLOCK_K, TMA, GATHER)
            g = weight_tile(w, gate_row, k0, n_ok, hidden, BLOCK_N, BLOCK_K, TMA)
            u = weight_tile(w, gate_row + inter, k0, n_ok, hidden, BLOCK_N, BLOCK_K, TMA)
            if FP8:
                a_s = tl.load(x_scale + tokens * h_groups + k0 // 128, mask=valid, other=0.0)[:, None]
                if BLOCK_N <= 128:  # the column block lies in one weight block: one scale each a step
                    g_s = tl.load(w_scale + gate_scale_row + k0 // 128)
                    u_s = tl.load(w_scale + gate_scale_row + i_groups * h_groups + k0 // 128)
                    acc_g += tl.dot(a, g) * (a_s * g_s)
                    acc_u += tl.dot(a, u) * (a_s * u_s)
                else:
                    g_s = tl.load(w_scale + gate_scale_rows + k0 // 128, mask=n_ok, other=0.0)
                    u_s = tl.load(w_scale + gate_scale_rows + i_groups * h_groups + k0 // 128, mask=n_ok, other=0.0)
                    acc_g += tl.dot(a, g) * (a_s * g_s[None, :])
                    acc_u += tl.dot(a, u) * (a_s * u_s[None, :])
            else:
                acc_g = tl.dot(a, g, acc_g)
                acc_u = tl.dot(a, u, acc_u)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) * up, in float32
    out_ptrs = act_ptr + rows[:, None].to(tl.int64) * inter + offs_n[None, :]
    if FP8:  # quantized per row per 128 columns here, for the down GEMM (BLOCK_N is a multiple of 128)
        quant, scale = quant_groups(tl.reshape(act, (BLOCK_M, BLOCK_N // 128, 128)), E4M3_MAX)
        tl.store(out_ptrs, tl.reshape(quant, (BLOCK_M, BLOCK_N)), mask=n_ok[None, :])
        groups = col * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
        tl.store(act_scale + rows[:, None].to(tl.int64) * i_groups + groups[None, :], scale,
                 mask=groups[None, :] < i_groups)
    else:
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _gate_up_tile(x, w, act_ptr, pairs_ptr, tile_expert_ptr, x_scale, w_scale, act_scale, tile, col, num_pairs, slots,
                  hidden, inter, layout_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  TMA: tl.constexpr, GATHER: tl.constexpr, ONE_DOT: tl.constexpr, HALVES: tl.constexpr,
                  FP8: tl.constexpr):
    """One (tile, column block) job of gate_up: the two-dot or ONE_DOT form, or HALVES' two passes."""
    if HALVES:
        gate_up_halves_job(x, w, act_ptr, pairs_ptr, tile_expert_ptr, x_scale, w_scale, act_scale, tile, col,
                           num_pairs, slots, hidden, inter, layout_m, BLOCK_M, BLOCK_N, BLOCK_K, TMA, GATHER, FP8)
    else:
        _gate_up_job(x, w, act_ptr, pairs_ptr, tile_expert_ptr, x_scale, w_scale, act_scale, tile, col, num_pairs,
                     slots, hidden, inter, layout_m, BLOCK_M, BLOCK_N, BLOCK_K, TMA, GATHER, ONE_DOT, FP8)


@triton.jit(do_not_specialize=["num_pairs", "layout_m", "group_m"])
def gate_up_kernel(
    x, w, act_ptr, pairs_ptr, tile_expert_ptr, used_tiles_ptr, x_scale, w_scale, act_scale,
    num_pairs, slots, hidden, inter, layout_m, group_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
    GATHER: tl.constexpr, ONE_DOT: tl.constexpr, FP8: tl.constexpr, PERSISTENT: tl.constexpr, PROGRAMS: tl.constexpr,
    HALVES: tl.constexpr = False, GDC: tl.constexpr = 0,
):
    """`x` is [T, H] (rows gathered here, per pair's token) or, with GATHER, the pre-gathered
    [rows, H] buffer (a TMA descriptor when TMA is on)."""
    gdc_enter(GDC)
    num_cols = tl.cdiv(inter, BLOCK_N)
    if PERSISTENT:  # every PROGRAMS-th job over the tiles of the used layout tiles
        num_tiles = tl.load(used_tiles_ptr) * (layout_m // BLOCK_M)
        for job in tl.range(tl.program_id(0), num_tiles * num_cols, PROGRAMS, flatten=True):
            tile, col = tile_and_col(job, num_tiles, num_cols, group_m)
            _gate_up_tile(x, w, act_ptr, pairs_ptr, tile_expert_ptr, x_scale, w_scale, act_scale, tile, col,
                          num_pairs, slots, hidden, inter, layout_m, BLOCK_M, BLOCK_N, BLOCK_K, TMA, GATHER, ONE_DOT,
                          HALVES, FP8)
    else:  # one job of the worst-case grid; a tile of padding only exits (an expert's real rows come first)
        tile, col = tile_and_col(tl.program_id(0), tl.num_programs(0) // num_cols, num_cols, group_m)
        if tl.load(pairs_ptr + tile * BLOCK_M) < num_pairs:
            _gate_up_tile(x, w, act_ptr, pairs_ptr, tile_expert_ptr, x_scale, w_scale, act_scale, tile, col,
                          num_pairs, slots, hidden, inter, layout_m, BLOCK_M, BLOCK_N, BLOCK_K, TMA, GATHER, ONE_DOT,
                          HALVES, FP8)


@triton.jit
def _down_job(act, w, out_ptr, shared_ptr, pairs_ptr, tile_expert_ptr, weights_ptr, act_scale, w_scale, tile, col,
              num_pairs, top_k, slots, hidden, inter, layout_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, TMA: tl.constexpr, FP8: tl.constexpr, SHARED_APART: tl.constexpr):
    """out[pair of each real row, col's block] = weight(pair) * act[row] @ down[e]ᵀ for one tile. With FP8 each
    step's product is added times act's row group scales (`act_scale` [rows, I/128]) and the weight blocks'
    (`w_scale` [E, H/128, I/128]). With SHARED_APART a routed pair's row goes to out[token·k + slot], a shared
    expert's to shared_ptr[token·S + slot - k] in that buffer's dtype (float32: never rounded before the sum)."""
    expert = tl.load(tile_expert_ptr + tile * BLOCK_M // layout_m)
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    down_row = expert * hidden + col * BLOCK_N  # rows of w viewed as [E * H, I]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    i_groups = tl.cdiv(inter, 128)
    a_scale_rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64) * i_groups
    b_scale_rows = (expert * tl.cdiv(hidden, 128) + offs_n // 128) * i_groups
    b_scale_row = (expert * tl.cdiv(hidden, 128) + col * BLOCK_N // 128) * i_groups
    for k0 in range(0, inter, BLOCK_K):
        a = row_tile(act, tile * BLOCK_M, k0, inter, BLOCK_M, BLOCK_K, TMA)
        b = weight_tile(w, down_row, k0, n_ok, inter, BLOCK_N, BLOCK_K, TMA)
        if FP8:
            a_s = tl.load(act_scale + a_scale_rows + k0 // 128)
            if BLOCK_N <= 128:  # the column block lies in one weight block: one scale a step
                acc += tl.dot(a, b) * (a_s * tl.load(w_scale + b_scale_row + k0 // 128))[:, None]
            else:
                b_s = tl.load(w_scale + b_scale_rows + k0 // 128, mask=n_ok, other=0.0)
                acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        else:
            acc = tl.dot(a, b, acc)
    pairs = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    slot = pairs % slots
    routed = valid & (slot < top_k)
    weight = tl.load(weights_ptr + (pairs // slots) * top_k + slot, mask=routed, other=1.0).to(tl.float32)
    acc = acc * weight[:, None]
    if SHARED_APART:
        token = (pairs // slots).to(tl.int64)
        out_ptrs = out_ptr + (token * top_k + slot)[:, None] * hidden + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=routed[:, None] & n_ok[None, :])
        shared_ptrs = shared_ptr + (token * (slots - top_k) + slot - top_k)[:, None] * hidden + offs_n[None, :]
        tl.store(shared_ptrs, acc.to(shared_ptr.dtype.element_ty), mask=(valid & ~routed)[:, None] & n_ok[None, :])
    else:
        out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * hidden + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "layout_m", "group_m"])
def down_kernel(
    act, w, out_ptr, shared_ptr, pairs_ptr, tile_expert_ptr, used_tiles_ptr, weights_ptr, act_scale, w_scale,
    num_pairs, top_k, slots, hidden, inter, layout_m, group_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr, FP8: tl.constexpr,
    PERSISTENT: tl.constexpr, PROGRAMS: tl.constexpr, SHARED_APART: tl.constexpr, GDC: tl.constexpr = 0,
):
    gdc_enter(GDC)
    num_cols = tl.cdiv(hidden, BLOCK_N)
    if PERSISTENT:
        num_tiles = tl.load(used_tiles_ptr) * (layout_m // BLOCK_M)
        for job in tl.range(tl.program_id(0), num_tiles * num_cols, PROGRAMS, flatten=True):
            tile, col = tile_and_col(job, num_tiles, num_cols, group_m)
            _down_job(act, w, out_ptr, shared_ptr, pairs_ptr, tile_expert_ptr, weights_ptr, act_scale, w_scale, tile,
                      col, num_pairs, top_k, slots, hidden, inter, layout_m, BLOCK_M, BLOCK_N, BLOCK_K, TMA, FP8,
                      SHARED_APART)
    else:
        tile, col = tile_and_col(tl.program_id(0), tl.num_programs(0) // num_cols, num_cols, group_m)
        if tl.load(pairs_ptr + tile * BLOCK_M) < num_pairs:
            _down_job(act, w, out_ptr, shared_ptr, pairs_ptr, tile_expert_ptr, weights_ptr, act_scale, w_scale, tile,
                      col, num_pairs, top_k, slots, hidden, inter, layout_m, BLOCK_M, BLOCK_N, BLOCK_K, TMA, FP8,
                      SHARED_APART)


def launch_gate_up(x, w_gate_up, act, layout: Layout, num_pairs: int, slots: int, block_m: int, cfg: dict,
                   x_rows=None, x_scale=None, w_scale=None, act_scale=None):
    """act[rows, I] = SiLU(x[pair token] @ gate[e]ᵀ) * (x @ up[e]ᵀ) for every real row (padding rows: garbage),
    `layout` being `align`'s. With GATHER the token rows are first copied into `x_rows` ([rows, H], x's dtype,
    the caller's). FP8 (an e4m3 `w_gate_up`): `x` is e4m3 with `x_scale` [T, H/128], `w_scale` the weight's
    [E, 2I/128, H/128] block scales, and act is written in e4m3 with `act_scale` [rows, I/128]. Returns the
    compiled kernel (`moe_launch.launch`)."""
    pairs, tile_expert, used_tiles = layout
    experts, inter, hidden = w_gate_up.shape[0], w_gate_up.shape[1] // 2, w_gate_up.shape[2]
    fp8 = w_gate_up.dtype == FP8
    if fp8 and (x_scale is None or w_scale is None or act_scale is None or inter % GROUP):
        raise ValueError(f"FP8 gate_up needs x_scale, w_scale and act_scale, and a width that is a multiple of "
                         f"{GROUP} (got {inter})")
    cfg = kernel_settings(cfg, block_m, fp8, "gate_up")
    cfg["TMA"] = cfg["TMA"] and tma_supported(x.device)
    cfg["ONE_DOT"] = cfg["ONE_DOT"] and cfg["TMA"]
    if cfg["GATHER"]:
        if x_rows is None:
            raise ValueError("GATHER needs x_rows: a [layout rows, hidden] buffer of x's dtype")
        gather_rows(x, x_rows, pairs, num_pairs, slots, block_m)
        x = operand(x_rows, [cfg["BLOCK_M"], cfg["BLOCK_K"]], cfg["TMA"])
    if cfg["TMA"] and (cfg["ONE_DOT"] or cfg["HALVES"]):  # [2E, I, H]: block 2e is expert e's gate rows, 2e + 1 its
        blocks = w_gate_up.view(2 * experts, inter, hidden)  # up rows; HALVES' box holds half a column block of each
        box = [2, cfg["BLOCK_N"] // (2 if cfg["HALVES"] else 1), cfg["BLOCK_K"]]
        w = TensorDescriptor(blocks, list(blocks.shape), list(blocks.stride()), box)
    else:
        w = operand(w_gate_up, [cfg["BLOCK_N"], cfg["BLOCK_K"]], cfg["TMA"])
    scales = (x_scale, w_scale, act_scale) if fp8 else (act, act, act)  # unread placeholders without FP8
    args = (x, w, act, pairs, tile_expert, used_tiles, *scales, num_pairs, slots, hidden, inter)
    return launch(gate_up_kernel, args, pairs.shape[0], triton.cdiv(inter, cfg["BLOCK_N"]), block_m, cfg,
                   act.device, GATHER=cfg["GATHER"], ONE_DOT=cfg["ONE_DOT"], HALVES=cfg["HALVES"], FP8=fp8)


def launch_down(act, w_down, out, layout: Layout, weights, num_pairs: int, top_k: int, slots: int,
                block_m: int, cfg: dict, act_scale=None, w_scale=None, shared_out=None):
    """out[pair, H] = weight(pair) * act[row of pair] @ down[e]ᵀ for every real pair (weight 1: shared).
    FP8 (an e4m3 `w_down`): act is e4m3 with `act_scale` [rows, I/128], `w_scale` [E, H/128, I/128].
    With `shared_out` ([T·S, H], float32) the shared experts' rows go there and `out` holds the routed pairs'
    only ([T·k, H], token·k + slot)."""
    pairs, tile_expert, used_tiles = layout
    hidden, inter = w_down.shape[1], w_down.shape[2]
    fp8 = w_down.dtype == FP8
    if fp8 and (act_scale is None or w_scale is None):
        raise ValueError("FP8 down needs act_scale and w_scale")
    cfg = kernel_settings(cfg, block_m, fp8, "down")
    cfg["TMA"] = cfg["TMA"] and tma_supported(act.device)
    a = operand(act, [cfg["BLOCK_M"], cfg["BLOCK_K"]], cfg["TMA"])
    w = operand(w_down, [cfg["BLOCK_N"], cfg["BLOCK_K"]], cfg["TMA"])
    scales = (act_scale, w_scale) if fp8 else (out, out)  # unread placeholders without FP8
    shared = out if shared_out is None else shared_out  # an unwritten placeholder without shared rows apart
    args = (a, w, out, shared, pairs, tile_expert, used_tiles, weights, *scales, num_pairs, top_k, slots, hidden,
            inter)
    return launch(down_kernel, args, pairs.shape[0], triton.cdiv(hidden, cfg["BLOCK_N"]), block_m, cfg,
                   act.device, FP8=fp8, SHARED_APART=shared_out is not None)
