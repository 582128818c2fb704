"""Moving rows for the fused MoE (`moe_triton`): the gather of gate_up's A rows into layout order, and the
sum over each token's pair rows that ends the MoE.

`gather_rows` copies each real row's token row of `x` into a caller's buffer (zeros for padding) before a
gate_up set to GATHER; `sum_slots` adds each token's k + S pair rows, written by `down` in pair order (or the
routed ones in token order and the shared ones, float32, apart), in float32 and slot order, rounded once, so
the result does not depend on the tiling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd.kernels.pdl import gdc_enter, launch_options


@triton.jit(do_not_specialize=["num_pairs", "layout_m"])
def _gather_kernel(x_ptr, x_rows_ptr, pairs_ptr, num_pairs, slots, hidden, layout_m,
                   ROWS: tl.constexpr, COLS: tl.constexpr, GDC: tl.constexpr = 0):
    """x_rows[row] = x[token of pairs[row]], zeros for padding rows, for ROWS rows and COLS columns.
    Skips layout tiles of padding only (gate_up never reads them); ROWS divides the layout's block_m."""
    gdc_enter(GDC)
    row0 = tl.program_id(0) * ROWS
    if tl.load(pairs_ptr + row0 // layout_m * layout_m) >= num_pairs:
        return
    rows = row0 + tl.arange(0, ROWS)
    pairs = tl.load(pairs_ptr + rows)
    tokens = (pairs // slots).to(tl.int64)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    in_row = cols[None, :] < hidden
    values = tl.load(x_ptr + tokens[:, None] * hidden + cols[None, :], mask=(pairs < num_pairs)[:, None] & in_row,
                     other=0.0)
    tl.store(x_rows_ptr + rows[:, None].to(tl.int64) * hidden + cols[None, :], values, mask=in_row)


GATHER_ROWS, GATHER_COLS = 16, 512  # a gather program's block; 16 divides every layout block_m


def gather_rows(x, x_rows, pairs, num_pairs: int, slots: int, block_m: int) -> None:
    """x_rows[row] = x[pairs[row] // slots] for each row of every layout tile with a real row (padding rows:
    zeros); one launch over the worst-case rows, tiles of padding only exit."""
    hidden = x.shape[1]
    grid = (pairs.shape[0] // GATHER_ROWS, triton.cdiv(hidden, GATHER_COLS))
    _gather_kernel[grid](x, x_rows, pairs, num_pairs, slots, hidden, block_m, ROWS=GATHER_ROWS, COLS=GATHER_COLS,
                         num_warps=4, **launch_options(x.device))


@triton.jit
def _sum_slots_kernel(pair_rows, shared_rows, out, hidden, SLOTS: tl.constexpr, SHARED: tl.constexpr,
                      BLOCK: tl.constexpr, GDC: tl.constexpr = 0):
    """out[token, cols] = Σ over the token's SLOTS pair rows, in float32, slot 0 first, rounded once; the last
    SHARED slots' rows read from `shared_rows` ([T·SHARED, H]), the others' from `pair_rows`
    ([T·(SLOTS - SHARED), H])."""
    gdc_enter(GDC)
    ROUTED: tl.constexpr = SLOTS - SHARED
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for slot in tl.static_range(ROUTED):
        acc += tl.load(pair_rows + (token * ROUTED + slot) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    for slot in tl.static_range(SHARED):
        acc += tl.load(shared_rows + (token * SHARED + slot) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + token * hidden + cols, acc.to(out.dtype.element_ty), mask=ok)


SUM_COLS = 1024  # columns per program of the slot sum


def sum_slots(pair_rows: torch.Tensor, slots: int, dtype: torch.dtype, shared_rows: torch.Tensor | None = None,
              num_shared: int = 0) -> torch.Tensor:
    """[T, H] of `dtype`: each token's `slots` consecutive rows of `pair_rows` ([T·slots, H]) summed; with
    `shared_rows` ([T·num_shared, H]) the last `num_shared` slots' rows are there, `pair_rows` holding the
    others' ([T·(slots - num_shared), H])."""
    shared = num_shared if shared_rows is not None else 0
    if shared_rows is not None and (not shared or shared_rows.shape[0] % shared):
        raise ValueError(f"shared rows {tuple(shared_rows.shape)} for {num_shared} shared slots")
    hidden = pair_rows.shape[1]
    tokens = shared_rows.shape[0] // shared if shared else pair_rows.shape[0] // slots
    out = torch.empty(tokens, hidden, dtype=dtype, device=pair_rows.device)
    if tokens:
        _sum_slots_kernel[(tokens, triton.cdiv(hidden, SUM_COLS))](
            pair_rows, pair_rows if shared_rows is None else shared_rows, out, hidden, SLOTS=slots, SHARED=shared,
            BLOCK=SUM_COLS, num_warps=4, **launch_options(out.device))
    return out
