"""Routed (and fused shared) experts on CUDA without a host synchronisation.

Two implementations of one function, `experts(x, weights, ids, gate_up, down)`:
`triton` (two fused kernels, `moe_triton`) and `grouped` (`torch._grouped_mm` with a
gather and a reordering pass). Both are capturable in CUDA graphs: every shape follows
from the token count, never from the routing. `AFD_MOE_KERNEL` picks one
(auto|triton|grouped); auto prefers Triton when it imports.

Shared experts of width n·I are folded in as n extra experts that every token visits
with weight 1 (`fuse_shared_experts`), so one kernel pair does the whole MoE layer.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from afd.kernels import triton_available


def kernel_choice() -> str:
    choice = os.environ.get("AFD_MOE_KERNEL", "auto")
    if choice not in ("auto", "triton", "grouped"):
        raise ValueError(f"AFD_MOE_KERNEL={choice!r}: must be auto, triton or grouped")
    if choice == "auto":
        return "triton" if triton_available() else "grouped"
    return choice


def tile_config(num_pairs: int, num_experts: int) -> dict:
    """Triton block sizes for `num_pairs` token→expert pairs (pure; a function of shapes only)."""
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, 64, 4, 4
    elif per_expert <= 48:
        block_m, block_n, block_k, warps, stages = 32, 64, 64, 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 64, 128, 64, 4, 4
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)


def align_pairs(flat_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert's run padded to a multiple of `block_m`.

    Returns (`pairs` [max_rows] int32: the pair index in each padded row, `P` for padding;
    `tile_expert` [max_rows / block_m] int32: each tile's expert, -1 past the used rows).
    `max_rows` is the worst case for P pairs, so no shape depends on the routing.
    """
    num_pairs = flat_ids.numel()
    device = flat_ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # bincount without its host sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat_ids, stable=True)  # [P] pair indices grouped by expert
    sorted_ids = flat_ids[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_ids]
    dest = (padded_end - padded)[sorted_ids] + rank
    max_rows = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    pairs[dest] = order.to(torch.int32)
    tile_start = torch.arange(0, max_rows, block_m, device=device)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return pairs, tile_expert


def add_shared(weights: torch.Tensor, ids: torch.Tensor, num_routed: int, num_shared: int):
    """Append the shared experts (ids num_routed.., weight 1) to every token's routing."""
    if not num_shared:
        return weights, ids
    tokens = ids.shape[0]
    shared_ids = torch.arange(num_routed, num_routed + num_shared, device=ids.device).expand(tokens, num_shared)
    shared_w = torch.ones(tokens, num_shared, dtype=weights.dtype, device=weights.device)
    return torch.cat((weights, shared_w), 1), torch.cat((ids, shared_ids), 1)


def experts_triton(x, weights, ids, gate_up, down) -> torch.Tensor:
    """[T, H] output of the experts in `ids` ([T, k]) weighted by `weights` ([T, k])."""
    from afd.kernels import moe_triton

    tokens, top_k = ids.shape
    num_experts, inter = gate_up.shape[0], down.shape[2]
    num_pairs = tokens * top_k
    cfg = tile_config(num_pairs, num_experts)
    pairs, tile_expert = align_pairs(ids.reshape(-1), num_experts, cfg["BLOCK_M"])
    act = torch.empty(pairs.shape[0], inter, dtype=x.dtype, device=x.device)  # [padded rows, I]
    moe_triton.launch_gate_up(x.contiguous(), gate_up, act, pairs, tile_expert, num_pairs, top_k, cfg)
    out = torch.empty(num_pairs, x.shape[1], dtype=x.dtype, device=x.device)  # [T*k, H] in token order
    moe_triton.launch_down(act, down, out, pairs, tile_expert, weights.reshape(-1).contiguous(), num_pairs, cfg)
    return out.view(tokens, top_k, -1).sum(dim=1)


def experts_grouped(x, weights, ids, gate_up, down) -> torch.Tensor:
    """The same function on `torch._grouped_mm`: gather, two grouped GEMMs, reorder, weighted sum."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.to(torch.int32), torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    hidden = torch._grouped_mm(x[order // top_k], gate_up.transpose(1, 2), offs=offsets)  # [T*k, 2I]
    gate, up = hidden.chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)  # [T*k, H] sorted
    unsorted = torch.empty_like(out).index_copy_(0, order, out).view(tokens, top_k, -1)
    return torch.bmm(weights.unsqueeze(1).to(out.dtype), unsorted).squeeze(1)  # [T, H]


def experts_cuda(x, weights, ids, gate_up, down) -> torch.Tensor:
    if kernel_choice() == "triton":
        return experts_triton(x, weights, ids, gate_up, down)
    return experts_grouped(x, weights, ids, gate_up, down)


def fuse_shared_experts(moe) -> None:
    """Fold `moe.shared_experts` (width n·I) into `moe.experts` as n extra experts; frees the MLP."""
    shared, experts = moe.shared_experts, moe.experts
    if shared is None or experts is None:
        return
    inter = experts.down.shape[2]
    width = shared.down_proj.weight.shape[1]
    if width % inter or shared.gate_proj.bias is not None:
        return  # not expressible as whole experts: keep the separate MLP
    count = width // inter
    gate = shared.gate_proj.weight.view(count, inter, -1)  # [n, I, H]
    up = shared.up_proj.weight.view(count, inter, -1)
    down = shared.down_proj.weight.view(-1, count, inter).transpose(0, 1)  # [n, H, I]
    with torch.no_grad():
        experts.gate_up = torch.nn.Parameter(torch.cat((experts.gate_up, torch.cat((gate, up), 1))), requires_grad=False)
        experts.down = torch.nn.Parameter(torch.cat((experts.down, down.contiguous())), requires_grad=False)
    experts.num_shared = count
    moe.shared_experts = None
