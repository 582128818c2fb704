"""Fused MoE in two Triton kernels: gather + gate/up GEMM + SiLU·mul, then down GEMM + weight.

Token→expert pairs are laid out by `align_pairs` so that every tile of `block_m` rows
belongs to one expert (each expert's rows padded to a tile multiple). Kernel 1 gathers
token rows straight from `x` (no gathered copy), multiplies by the expert's gate and
up weights and writes SiLU(gate)·up; kernel 2 multiplies by the down weights, scales
by the routing weight and writes each pair's row in token order, so the final sum over
a token's k pairs is a plain deterministic reduction. No host synchronisation: grid
sizes come from the worst case, and tiles past the used rows exit at once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, act_ptr, pairs_ptr, tile_expert_ptr,
    num_pairs, top_k, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile, col = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows)  # [BM] pair index, num_pairs = padding
    valid = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * hidden + offs_k[None, :]  # [BM, BK]
    g_ptrs = w_ptr + expert * 2 * inter * hidden + offs_n[None, :].to(tl.int64) * hidden + offs_k[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + inter * hidden
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k + k0 < hidden
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g)
        acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) * up, in float32
    out_ptrs = act_ptr + rows[:, None].to(tl.int64) * inter + offs_n[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, out_ptr, pairs_ptr, tile_expert_ptr, pair_weight_ptr,
    num_pairs, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile, col = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows)
    valid = pairs < num_pairs
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * inter + offs_k[None, :]  # [BM, BK]
    b_ptrs = w_ptr + expert * hidden * inter + offs_n[None, :].to(tl.int64) * inter + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = offs_k + k0 < inter
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    weight = tl.load(pair_weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * hidden + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def launch_gate_up(x, w_gate_up, act, pairs, tile_expert, num_pairs: int, top_k: int, cfg: dict) -> None:
    """act[rows, I] = SiLU(x[pair token] @ gate[e]ᵀ) * (x @ up[e]ᵀ) for every padded row."""
    inter, hidden = w_gate_up.shape[1] // 2, w_gate_up.shape[2]
    grid = (tile_expert.shape[0], triton.cdiv(inter, cfg["BLOCK_N"]))
    _gate_up_kernel[grid](
        x, w_gate_up, act, pairs, tile_expert, num_pairs, top_k, hidden, inter,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def launch_down(act, w_down, out, pairs, tile_expert, pair_weights, num_pairs: int, cfg: dict) -> None:
    """out[pair, H] = weight[pair] * act[row of pair] @ down[e]ᵀ for every real pair."""
    hidden, inter = w_down.shape[1], w_down.shape[2]
    grid = (tile_expert.shape[0], triton.cdiv(hidden, cfg["BLOCK_N"]))
    _down_kernel[grid](
        act, w_down, out, pairs, tile_expert, pair_weights, num_pairs, hidden, inter,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )

