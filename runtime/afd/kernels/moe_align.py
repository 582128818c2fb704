"""The Triton MoE's alignment: the (token, slot) pairs laid out in tiles of one expert each.

A *pair* is one (token, slot): slots 0..k-1 are the token's routed experts, slots
k..k+S-1 its S shared experts (folded in as experts every token visits with weight 1),
so pair p = token·(k+S) + slot and nothing is concatenated on the host side.

`align` lays the pairs out so that every tile of `block_m` rows belongs to one expert,
each expert's run padded to a tile multiple: count (a histogram per block, atomics
across blocks), offsets (a few programs: padded prefix sum, the expert of every tile,
padding rows marked), scatter (an atomic cursor per routed expert; shared experts'
rows are in token order). That is four launches (the counters' zeroing too) where a sort took about twenty;
up to `ONE_PROGRAM_PAIRS` pairs (every decode step) one program does all of it in one launch.
The order of pairs inside an expert's run depends on the atomics, but each row's
result does not: a GEMM row depends only on its own input row. The GEMM kernels of
`moe_triton` read the `Layout`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from afd.kernels.pdl import gdc_enter, launch_options


@triton.jit
def _pair_expert(ids_ptr, p, ok, top_k, slots, num_routed):
    """Expert of pair `p`: its routed id for slots < k, else the shared expert of that slot."""
    token = p // slots
    slot = p % slots
    routed = slot < top_k
    expert = tl.load(ids_ptr + token * top_k + slot, mask=ok & routed, other=0).to(tl.int32)
    return tl.where(routed, expert, num_routed + slot - top_k)


@triton.jit(do_not_specialize=["num_pairs"])  # one compiled variant whatever the token count
def _count_kernel(ids_ptr, counts_ptr, num_pairs, top_k, slots, num_routed, num_experts,
                  BLOCK: tl.constexpr, NUM_BINS: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < num_pairs
    expert = tl.where(ok, _pair_expert(ids_ptr, p, ok, top_k, slots, num_routed), NUM_BINS - 1)
    hist = tl.histogram(expert, NUM_BINS)  # the spare last bin takes the lanes past the end
    bins = tl.arange(0, NUM_BINS)
    tl.atomic_add(counts_ptr + bins, hist, mask=(bins < num_experts) & (hist > 0))


@triton.jit(do_not_specialize=["num_pairs", "max_tiles"])
def _offsets_kernel(counts_ptr, starts_ptr, tile_expert_ptr, used_tiles_ptr, pairs_ptr, num_experts, num_pairs,
                    max_tiles, BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, CHUNK: tl.constexpr):
    """Every program computes the padded prefix sum (a few hundred counts) and writes its share of the
    tiles' experts and of the padding marks; program 0 also the starts and the used tile count."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    experts = tl.arange(0, NUM_BINS)
    valid = experts < num_experts
    counts = tl.load(counts_ptr + experts, mask=valid, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    if pid == 0:
        tl.store(starts_ptr + experts, ends - padded, mask=valid)
        tl.store(used_tiles_ptr, tl.sum(padded, 0) // BLOCK_M)
    ends = tl.where(valid, ends, 1 << 30)
    for first in tl.range(pid * CHUNK, max_tiles, programs * CHUNK):
        tiles = first + tl.arange(0, CHUNK)
        owner = tl.sum((ends[None, :] <= tiles[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(tile_expert_ptr + tiles, tl.where(owner < num_experts, owner, -1), mask=tiles < max_tiles)
    for first in tl.range(pid * 1024, max_tiles * BLOCK_M, programs * 1024):  # every row starts as padding
        rows = first + tl.arange(0, 1024)
        tl.store(pairs_ptr + rows, tl.full((1024,), 0, tl.int32) + num_pairs, mask=rows < max_tiles * BLOCK_M)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(ids_ptr, starts_ptr, cursor_ptr, pairs_ptr, num_pairs, top_k, slots, num_routed,
                    BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < num_pairs
    expert = _pair_expert(ids_ptr, p, ok, top_k, slots, num_routed)
    routed = (p % slots) < top_k
    taken = tl.atomic_add(cursor_ptr + expert, tl.full((BLOCK,), 1, tl.int32), mask=ok & routed)
    rank = tl.where(routed, taken, p // slots)  # a shared expert has exactly one pair per token
    dest = tl.load(starts_ptr + expert, mask=ok, other=0) + rank
    tl.store(pairs_ptr + dest, p.to(tl.int32), mask=ok)


@triton.jit(do_not_specialize=["num_pairs", "max_tiles"])
def _align_one_kernel(ids_ptr, cursor_ptr, pairs_ptr, tile_expert_ptr, used_tiles_ptr, num_pairs, top_k, slots,
                      num_routed, num_experts, max_tiles, BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr,
                      BLOCK: tl.constexpr, TILE_BINS: tl.constexpr, GDC: tl.constexpr = 0):
    """The whole alignment in one program (a decode step's few thousand pairs): count, padded prefix sum, tiles'
    experts, every row marked as padding, then each pair scattered through a cursor per expert that starts at its
    expert's first row. The barriers order this program's own writes (padding marks, cursors) before its reads."""
    gdc_enter(GDC)
    experts = tl.arange(0, NUM_BINS)
    valid = experts < num_experts
    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for first in tl.range(0, num_pairs, BLOCK):
        p = first + tl.arange(0, BLOCK)
        ok = p < num_pairs
        counts += tl.histogram(tl.where(ok, _pair_expert(ids_ptr, p, ok, top_k, slots, num_routed), NUM_BINS - 1),
                               NUM_BINS)  # the spare last bin takes the lanes past the end
    counts = tl.where(valid, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + experts, ends - padded, mask=valid)
    tl.store(used_tiles_ptr, tl.sum(padded, 0) // BLOCK_M)
    # tile t's expert = how many experts end at or before it: a histogram of the experts' last tiles, summed up
    # (TILE_BINS > every tile index; experts past the last take the spare last bin)
    ended = tl.cumsum(tl.histogram(tl.where(valid, ends // BLOCK_M, TILE_BINS - 1), TILE_BINS), 0)
    tiles = tl.arange(0, TILE_BINS)
    tl.store(tile_expert_ptr + tiles, tl.where(ended < num_experts, ended, -1), mask=tiles < max_tiles)
    for first in tl.range(0, max_tiles * BLOCK_M, BLOCK):  # every row starts as padding
        rows = first + tl.arange(0, BLOCK)
        tl.store(pairs_ptr + rows, tl.full((BLOCK,), 0, tl.int32) + num_pairs, mask=rows < max_tiles * BLOCK_M)
    tl.debug_barrier()
    for first in tl.range(0, num_pairs, BLOCK):
        p = first + tl.arange(0, BLOCK)
        ok = p < num_pairs
        expert = _pair_expert(ids_ptr, p, ok, top_k, slots, num_routed)
        routed = (p % slots) < top_k
        # a routed pair takes its expert's next row; a shared expert (never counted on) has one pair per token
        taken = tl.atomic_add(cursor_ptr + expert, tl.full((BLOCK,), 1, tl.int32), mask=ok & routed)
        shared_row = tl.load(cursor_ptr + expert, mask=ok & ~routed, other=0) + p // slots
        tl.store(pairs_ptr + tl.where(routed, taken, shared_row), p.to(tl.int32), mask=ok)


OFFSETS_PROGRAMS = 32  # the offsets kernel's grid at most: each program marks 1,024 rows a turn
ONE_PROGRAM_PAIRS = 4096  # up to this many pairs (a decode step's) `align` is one launch, past it four


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded layout in the worst case (each expert wastes up to block_m - 1)."""
    return triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m


class Layout(NamedTuple):
    """Where `align` put the pairs, for the GEMM kernels."""

    pairs: torch.Tensor  # [max_rows] int32: pair index per padded row, `num_pairs` for padding
    tile_expert: torch.Tensor  # [max_rows / block_m] int32: each tile's expert, -1 past the used rows
    used_tiles: torch.Tensor  # [1] int32: how many tiles have a real row (they come first)


def align(ids: torch.Tensor, num_shared: int, num_experts: int, block_m: int) -> Layout:
    """Lay the pairs of `ids` ([tokens, k] routed experts; `num_shared` shared experts after them) out in
    tiles of `block_m` rows of one expert each."""
    tokens, top_k = ids.shape
    slots = top_k + num_shared
    num_pairs, num_routed = tokens * slots, num_experts - num_shared
    rows = max_rows(num_pairs, num_experts, block_m)
    device = ids.device
    used_tiles = torch.empty(1, dtype=torch.int32, device=device)
    pairs = torch.empty(rows, dtype=torch.int32, device=device)
    tile_expert = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(num_experts + 1)
    block = 1024
    ids = ids.contiguous()
    if num_pairs <= ONE_PROGRAM_PAIRS:
        cursors = torch.empty(num_experts, dtype=torch.int32, device=device)
        tile_bins = triton.next_power_of_2(max_rows(ONE_PROGRAM_PAIRS, num_experts, block_m) // block_m + 1)
        _align_one_kernel[(1,)](ids, cursors, pairs, tile_expert, used_tiles, num_pairs, top_k, slots, num_routed,
                                num_experts, rows // block_m, BLOCK_M=block_m, NUM_BINS=bins, BLOCK=block,
                                TILE_BINS=tile_bins, num_warps=8, **launch_options(ids.device))
        return Layout(pairs, tile_expert, used_tiles)
    counters = torch.zeros(2, num_experts, dtype=torch.int32, device=device)  # counts, cursors
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    _count_kernel[(triton.cdiv(num_pairs, block),)](
        ids, counters[0], num_pairs, top_k, slots, num_routed, num_experts, BLOCK=block, NUM_BINS=bins, num_warps=4)
    _offsets_kernel[(min(OFFSETS_PROGRAMS, triton.cdiv(rows, 1024)),)](
        counters[0], starts, tile_expert, used_tiles, pairs, num_experts, num_pairs, rows // block_m,
        BLOCK_M=block_m, NUM_BINS=bins, CHUNK=max(16, 4096 // bins), num_warps=4)
    _scatter_kernel[(triton.cdiv(num_pairs, block),)](
        ids, starts, counters[1], pairs, num_pairs, top_k, slots, num_routed, BLOCK=block, num_warps=4)
    return Layout(pairs, tile_expert, used_tiles)
