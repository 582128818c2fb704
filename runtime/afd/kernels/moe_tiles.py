"""The MoE GEMM kernels' building blocks (`moe_triton`): which tile and column block a
program takes, and the A and weight tiles of one K step, through TMA descriptors or pointer loads."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_and_col(pid, num_tiles, num_cols, group_m):
    """(tile, column block) of job `pid`. Groups of `group_m` tiles sweep every column block
    with the tile fastest, so a group's A rows stay in L2 while its columns go by; a group of
    all tiles is plain column-major order (every tile of column block 0, then of 1, …)."""
    per_group = group_m * num_cols
    first = pid // per_group * group_m
    size = tl.minimum(num_tiles - first, group_m)
    return first + pid % per_group % size, pid % per_group // size


@triton.jit
def weight_tile(w, row0, k0, n_ok, num_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """[BK, BN]: weight rows row0.. (the output columns) at inputs k0.. of a [rows, num_k] matrix,
    through a TMA descriptor or a masked pointer load. A TMA tile past an expert's last row reads
    the next rows (or zeros); those columns are never stored."""
    if TMA:
        tile = w.load([row0, k0]).T
    else:
        offs_n = row0 + tl.arange(0, BLOCK_N)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ptrs = w + offs_n[None, :].to(tl.int64) * num_k + offs_k[:, None]
        tile = tl.load(ptrs, mask=(offs_k[:, None] < num_k) & n_ok[None, :], other=0.0)
    return tile


@triton.jit
def row_tile(a, row0, k0, num_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """[BM, BK]: rows row0.. at inputs k0.. of a contiguous [rows, num_k] matrix, through a TMA
    descriptor or a pointer load (inputs past num_k: zeros)."""
    if TMA:
        tile = a.load([row0, k0])
    else:
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ptrs = a + offs_m[:, None].to(tl.int64) * num_k + offs_k[None, :]
        tile = tl.load(ptrs, mask=offs_k[None, :] < num_k, other=0.0)
    return tile


@triton.jit
def gate_up_rows(x, tile, tokens, valid, k0, hidden, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                  TMA: tl.constexpr, GATHER: tl.constexpr):
    """[BM, BK]: gate_up's A tile at inputs k0.., from the pre-gathered rows (GATHER) or straight from x."""
    if GATHER:
        a = row_tile(x, tile * BLOCK_M, k0, hidden, BLOCK_M, BLOCK_K, TMA)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x + tokens[:, None] * hidden + offs_k[None, :], mask=valid[:, None] & (offs_k[None, :] < hidden),
                    other=0.0)
    return a
