"""Moving rows for the fused MoE (`moe_triton`): the gather of gate_up's A rows into layout order, and the
sum over each token's pair rows that ends the MoE.

`gather_rows` copies each real row's token row of `x` into a caller's buffer (zeros for padding) before a
gate_up set to GATHER; `sum_slots` adds each token's k + S pair rows, written by `down` in pair order, in
float32 and slot order, rounded once, so the result does not depend on the tiling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_pairs", "layout_m"])
def _gather_kernel(x_ptr, x_rows_ptr, pairs_ptr, num_pairs, slots, hidden, layout_m,
                   ROWS: tl.constexpr, COLS: tl.constexpr):
    """x_rows[row] = x[token of pairs[row]], zeros for padding rows, for ROWS rows and COLS columns.
    Skips layout tiles of padding only (gate_up never reads them); ROWS divides the layout's block_m."""
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
                         num_warps=4)


@triton.jit
def _sum_slots_kernel(pair_rows, out, hidden, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """out[token, cols] = Σ over the token's SLOTS pair rows, in float32, slot 0 first, rounded once."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for slot in tl.static_range(SLOTS):
        acc += tl.load(pair_rows + (token * SLOTS + slot) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + token * hidden + cols, acc.to(out.dtype.element_ty), mask=ok)


SUM_COLS = 1024  # columns per program of the slot sum


def sum_slots(pair_rows: torch.Tensor, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, H] of `dtype`: each token's `slots` consecutive rows of `pair_rows` ([T·slots, H]) summed."""
    hidden = pair_rows.shape[1]
    tokens = pair_rows.shape[0] // slots
    out = torch.empty(tokens, hidden, dtype=dtype, device=pair_rows.device)
    if tokens:
        _sum_slots_kernel[(tokens, triton.cdiv(hidden, SUM_COLS))](pair_rows, out, hidden, SLOTS=slots,
                                                                    BLOCK=SUM_COLS, num_warps=4)
    return out
