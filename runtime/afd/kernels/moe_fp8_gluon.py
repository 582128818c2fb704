"""The FP8 MoE GEMMs (`moe_triton`'s gate_up and down) written in Gluon for Hopper, so that each K step's block-scale
promotion overlaps the next step's tensor-core work.

Triton's own kernels must wait for every wgmma before they scale its product (`acc += dot * scale`: FP8 block
scales change every 128 inputs), so the tensor cores idle while the CUDA cores promote (bench/RESULTS.md, issue 32,
sessions 40-43). Gluon issues the wgmma and its wait explicitly: a K step's product is issued into a fresh
accumulator and left in flight (`warpgroup_mma(..., use_acc=False, is_async=True)`); then the step before's product
is waited for (`warpgroup_mma_wait(num_outstanding=1)`: at most the newest one still running), scaled and added, and
its shared-memory stage refilled by TMA for a later step. The same sums in the same order as `moe_triton` (each
step's 128-deep product scaled by the A row's and the weight block's scales, added step after step in K order), so
the result is the same function at FP8's precision.

What the kernels take is `moe_triton`'s FP8 case with TMA (`GATHER` for gate_up: its A rows pre-gathered in layout
order): BLOCK_K 128, gate_up's BLOCK_N 128 (its epilogue quantizes act per 128 columns), down's BLOCK_N at most 128
(one weight block a column block). One program per (tile, column block) of the worst-case grid; a tile of padding
exits. `moe_launch.kernel_settings` checks a table entry's `GLUON`; `moe_triton` launches these instead of its
own kernels where it is on.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from afd.kernels.fp8_gemm import FP8_MAX

E4M3_MAX = gl.constexpr(FP8_MAX)


@triton.constexpr_function
def mma_layout(block_m, block_n, num_warps):
    """The wgmma accumulator layout: warps stacked along M first (16 rows each, at least 4 a warpgroup), then N."""
    warps_m = min(num_warps, max(4, block_m // 16))
    warps_n = num_warps // warps_m
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, warps_n],
                                     instr_shape=[16, block_n // warps_n, 32])


@gluon.jit
def _tile_and_col(pid, num_tiles, num_cols, group_m):
    """moe_tiles.tile_and_col: groups of `group_m` tiles sweep every column block, the tile fastest."""
    per_group = group_m * num_cols
    first = pid // per_group * group_m
    size = gl.minimum(num_tiles - first, group_m)
    return first + pid % per_group % size, pid % per_group // size


@gluon.jit
def _load_step(a_desc, a_row, b_desc, b_row, b_row2, k, bar, a_buf, b_buf, b_buf2, pred, TWO_B: gl.constexpr):
    """TMA copies of one K step's A tile and weight tile(s) into a stage, arriving on its barrier."""
    B_TILES: gl.constexpr = 2 if TWO_B else 1
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes * B_TILES
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [a_row, k], bar, a_buf, pred=pred)
    tma.async_copy_global_to_shared(b_desc, [b_row, k], bar, b_buf, pred=pred)
    if TWO_B:
        tma.async_copy_global_to_shared(b_desc, [b_row2, k], bar, b_buf2, pred=pred)


@gluon.jit(do_not_specialize=["num_pairs", "layout_m", "group_m"])  # no compile per token count
def _down_kernel(a_desc, b_desc, out_ptr, shared_ptr, pairs_ptr, tile_expert_ptr, weights_ptr, act_scale, w_scale,
                 num_pairs, top_k, slots, hidden, inter, layout_m, group_m,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                 SHARED_APART: gl.constexpr, num_warps: gl.constexpr):
    """out[pair of each real row, col's block] = weight(pair) · Σ_k (act_k @ down[e]_kᵀ) · a_s · w_s, as
    `moe_triton._down_job` with FP8 and TMA."""
    layout: gl.constexpr = mma_layout(BLOCK_M, BLOCK_N, num_warps)
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout)
    num_cols = gl.cdiv(hidden, BLOCK_N)
    tile, col = _tile_and_col(gl.program_id(0), gl.num_programs(0) // num_cols, num_cols, group_m)
    if gl.load(pairs_ptr + tile * BLOCK_M) < num_pairs:  # else a tile of padding only
        expert = gl.load(tile_expert_ptr + tile * BLOCK_M // layout_m)
        row0 = tile * BLOCK_M
        down_row = expert * hidden + col * BLOCK_N  # rows of the weights viewed as [E * H, I]
        i_groups = gl.cdiv(inter, 128)
        a_scale_rows = (row0 + gl.arange(0, BLOCK_M, layout=rows_l)).to(gl.int64) * i_groups
        b_scale_row = (expert * gl.cdiv(hidden, 128) + col * BLOCK_N // 128) * i_groups
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        steps = gl.cdiv(inter, BLOCK_K)
        for s in gl.static_range(STAGES):  # every stage filled before the first wgmma
            _load_step(a_desc, row0, b_desc, down_row, down_row, s * BLOCK_K, bars.index(s), a_bufs.index(s),
                       b_bufs.index(s), b_bufs.index(s), s < steps, False)
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        mbarrier.wait(bars.index(0), 0)
        prev = warpgroup_mma(a_bufs.index(0), b_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        prev_as = gl.load(act_scale + a_scale_rows)  # the scales are multiplied only when used, a step later,
        prev_ws = gl.load(w_scale + b_scale_row)  # so that their loads' latency hides behind a wgmma
        for step in range(1, steps):
            stage = step % STAGES
            mbarrier.wait(bars.index(stage), (step // STAGES) & 1)
            cur = warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), zero, use_acc=False,
                                is_async=True)
            k_group = step * BLOCK_K // 128
            cur_as = gl.load(act_scale + a_scale_rows + k_group)
            cur_ws = gl.load(w_scale + b_scale_row + k_group)
            done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))  # the step before's product
            acc = acc + done * gl.expand_dims(prev_as * prev_ws, 1)
            refill = step - 1 + STAGES  # into the stage that product read
            free = (step - 1) % STAGES
            _load_step(a_desc, row0, b_desc, down_row, down_row, refill * BLOCK_K, bars.index(free),
                       a_bufs.index(free), b_bufs.index(free), b_bufs.index(free), refill < steps, False)
            prev = cur
            prev_as = cur_as
            prev_ws = cur_ws
        done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
        acc = acc + done * gl.expand_dims(prev_as * prev_ws, 1)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        pairs = gl.load(pairs_ptr + row0 + gl.arange(0, BLOCK_M, layout=rows_l))
        offs_n = col * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_l)
        n_ok = gl.expand_dims(offs_n < hidden, 0)
        valid = pairs < num_pairs
        slot = pairs % slots
        routed = valid & (slot < top_k)
        weight = gl.load(weights_ptr + (pairs // slots) * top_k + slot, mask=routed, other=1.0).to(gl.float32)
        acc = acc * gl.expand_dims(weight, 1)
        if SHARED_APART:
            token = (pairs // slots).to(gl.int64)
            out_rows = gl.expand_dims((token * top_k + slot) * hidden, 1)
            gl.store(out_ptr + out_rows + gl.expand_dims(offs_n, 0), acc.to(out_ptr.dtype.element_ty),
                     mask=gl.expand_dims(routed, 1) & n_ok)
            shared_rows = gl.expand_dims((token * (slots - top_k) + slot - top_k) * hidden, 1)
            gl.store(shared_ptr + shared_rows + gl.expand_dims(offs_n, 0), acc.to(shared_ptr.dtype.element_ty),
                     mask=gl.expand_dims(valid & ~routed, 1) & n_ok)
        else:
            out_rows = gl.expand_dims(pairs.to(gl.int64) * hidden, 1)
            gl.store(out_ptr + out_rows + gl.expand_dims(offs_n, 0), acc.to(out_ptr.dtype.element_ty),
                     mask=gl.expand_dims(valid, 1) & n_ok)


@gluon.jit(do_not_specialize=["num_pairs", "layout_m", "group_m"])
def _gate_up_kernel(a_desc, b_desc, act_ptr, pairs_ptr, tile_expert_ptr, x_scale, w_scale, act_scale,
                    num_pairs, slots, hidden, inter, layout_m, group_m,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                    num_warps: gl.constexpr):
    """act[tile's rows, col's block] = SiLU(A @ gate) · (A @ up), quantized per row per 128 columns, as
    `moe_triton._gate_up_job` with FP8, TMA and GATHER (A: the pre-gathered rows); BLOCK_N is 128."""
    layout: gl.constexpr = mma_layout(BLOCK_M, BLOCK_N, num_warps)
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout)
    num_cols = gl.cdiv(inter, BLOCK_N)
    tile, col = _tile_and_col(gl.program_id(0), gl.num_programs(0) // num_cols, num_cols, group_m)
    if gl.load(pairs_ptr + tile * BLOCK_M) < num_pairs:
        expert = gl.load(tile_expert_ptr + tile * BLOCK_M // layout_m)
        row0 = tile * BLOCK_M
        rows = row0 + gl.arange(0, BLOCK_M, layout=rows_l)
        pairs = gl.load(pairs_ptr + rows)
        valid = pairs < num_pairs
        h_groups = gl.cdiv(hidden, 128)
        i_groups = inter // 128
        a_scale_rows = (pairs // slots).to(gl.int64) * h_groups  # x's scales are by token
        gate_row = expert * 2 * inter + col * BLOCK_N  # rows of the weights viewed as [E * 2I, H]
        gate_scale_row = (expert * 2 * i_groups + col) * h_groups
        up_scale_row = gate_scale_row + i_groups * h_groups
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        g_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        u_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        steps = gl.cdiv(hidden, BLOCK_K)
        for s in gl.static_range(STAGES):
            _load_step(a_desc, row0, b_desc, gate_row, gate_row + inter, s * BLOCK_K, bars.index(s),
                       a_bufs.index(s), g_bufs.index(s), u_bufs.index(s), s < steps, True)
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        acc_g = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        acc_u = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        mbarrier.wait(bars.index(0), 0)
        prev_g = warpgroup_mma(a_bufs.index(0), g_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        prev_u = warpgroup_mma(a_bufs.index(0), u_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        prev_as = gl.load(x_scale + a_scale_rows, mask=valid, other=0.0)  # multiplied when used (see _down_kernel)
        prev_gs = gl.load(w_scale + gate_scale_row)
        prev_us = gl.load(w_scale + up_scale_row)
        for step in range(1, steps):
            stage = step % STAGES
            mbarrier.wait(bars.index(stage), (step // STAGES) & 1)
            cur_g = warpgroup_mma(a_bufs.index(stage), g_bufs.index(stage).permute((1, 0)), zero, use_acc=False,
                                  is_async=True)
            cur_u = warpgroup_mma(a_bufs.index(stage), u_bufs.index(stage).permute((1, 0)), zero, use_acc=False,
                                  is_async=True)
            k_group = step * BLOCK_K // 128
            cur_as = gl.load(x_scale + a_scale_rows + k_group, mask=valid, other=0.0)
            cur_gs = gl.load(w_scale + gate_scale_row + k_group)
            cur_us = gl.load(w_scale + up_scale_row + k_group)
            done_g, done_u = warpgroup_mma_wait(num_outstanding=2, deps=(prev_g, prev_u))
            acc_g = acc_g + done_g * gl.expand_dims(prev_as * prev_gs, 1)
            acc_u = acc_u + done_u * gl.expand_dims(prev_as * prev_us, 1)
            refill = step - 1 + STAGES
            free = (step - 1) % STAGES
            _load_step(a_desc, row0, b_desc, gate_row, gate_row + inter, refill * BLOCK_K, bars.index(free),
                       a_bufs.index(free), g_bufs.index(free), u_bufs.index(free), refill < steps, True)
            prev_g = cur_g
            prev_u = cur_u
            prev_as = cur_as
            prev_gs = cur_gs
            prev_us = cur_us
        done_g, done_u = warpgroup_mma_wait(num_outstanding=0, deps=(prev_g, prev_u))
        acc_g = acc_g + done_g * gl.expand_dims(prev_as * prev_gs, 1)
        acc_u = acc_u + done_u * gl.expand_dims(prev_as * prev_us, 1)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        act = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u  # SiLU(gate) * up, in float32
        scale = gl.maximum(gl.max(gl.abs(act), axis=1) / E4M3_MAX, 1e-10 / E4M3_MAX)  # fp8_gemm.quant_groups
        quant = gl.minimum(gl.maximum(act / gl.expand_dims(scale, 1), -E4M3_MAX), E4M3_MAX)
        offs_n = col * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_l)
        out_rows = gl.expand_dims(rows.to(gl.int64) * inter, 1)
        gl.store(act_ptr + out_rows + gl.expand_dims(offs_n, 0), quant.to(gl.float8e4nv))
        gl.store(act_scale + rows.to(gl.int64) * i_groups + col, scale)


def _descriptor(tensor, block: list[int]) -> TensorDescriptor:
    matrix = tensor.view(-1, tensor.shape[-1])
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return TensorDescriptor(matrix, list(matrix.shape), list(matrix.stride()), block, layout)


def _grid(rows: int, cols: int, cfg: dict) -> tuple[int]:
    return (rows // cfg["BLOCK_M"] * cols,)


def launch_gate_up(x_rows, w_gate_up, act, pairs, tile_expert, num_pairs: int, slots: int, block_m: int, cfg: dict,
                   x_scale, w_scale, act_scale):
    """`moe_triton.launch_gate_up`'s FP8 case once its rows are gathered into `x_rows` ([rows, H] e4m3)."""
    inter, hidden = w_gate_up.shape[1] // 2, w_gate_up.shape[2]
    a = _descriptor(x_rows, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
    b = _descriptor(w_gate_up, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
    tiles = pairs.shape[0] // cfg["BLOCK_M"]
    return _gate_up_kernel[_grid(pairs.shape[0], triton.cdiv(inter, cfg["BLOCK_N"]), cfg)](
        a, b, act, pairs, tile_expert, x_scale, w_scale, act_scale, num_pairs, slots, hidden, inter, block_m,
        cfg["GROUP_M"] or tiles, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        STAGES=cfg["num_stages"], num_warps=cfg["num_warps"])


def launch_down(act, w_down, out, shared, pairs, tile_expert, weights, num_pairs: int, top_k: int, slots: int,
                block_m: int, cfg: dict, act_scale, w_scale, shared_apart: bool):
    """`moe_triton.launch_down`'s FP8 case."""
    hidden, inter = w_down.shape[1], w_down.shape[2]
    a = _descriptor(act, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
    b = _descriptor(w_down, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
    tiles = pairs.shape[0] // cfg["BLOCK_M"]
    return _down_kernel[_grid(pairs.shape[0], triton.cdiv(hidden, cfg["BLOCK_N"]), cfg)](
        a, b, out, shared, pairs, tile_expert, weights, act_scale, w_scale, num_pairs, top_k, slots, hidden, inter,
        block_m, cfg["GROUP_M"] or tiles, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        STAGES=cfg["num_stages"], SHARED_APART=shared_apart, num_warps=cfg["num_warps"])
