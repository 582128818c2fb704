"""Greedy top-k routing in one Triton kernel: softmax, top-k, renormalise or scale, cast.

`afd.models.layers.Routing.select` does the same in torch with six to eight launches
(softmax, topk, sum, divide, multiply, cast), which at 1 to 4,096 tokens cost more than the
arithmetic: each program here takes a block of tokens, holds their logits in registers and
writes the k weights and expert ids. Experts come out in descending weight, the lowest
expert id first among equal weights; a row whose logits hold a NaN still gets k distinct,
valid expert ids (with NaN weights, as torch gives), never an id that would index past the
experts. Capturable in CUDA graphs (no host synchronisation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 512  # one program holds a token's logits in registers


@triton.jit(do_not_specialize=["num_tokens"])
def _select_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride, scaling,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                   NORMALIZE: tl.constexpr, SCALE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    expert_ok = experts[None, :] < num_experts
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride + experts[None, :],
                     mask=row_ok[:, None] & expert_ok, other=0.0).to(tl.float32)
    logits = tl.where(expert_ok, logits, float("-inf"))
    shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    scores = shifted / tl.sum(shifted, axis=1)[:, None]  # softmax (NaN where the logits hold one)
    # the rank to pick by: padding and picked experts never again, NaN scores after every real one
    rank = tl.where(expert_ok, tl.where(scores == scores, scores, -1.0), float("-inf"))
    slots = tl.arange(0, K_PAD)
    top = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    top_ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(rank, axis=1)
        best_id = tl.min(tl.where(rank == best[:, None], experts[None, :], BLOCK_E), axis=1)
        best_id = tl.minimum(best_id, num_experts - 1)  # an id past the experts would index out of bounds later
        picked = experts[None, :] == best_id[:, None]
        weight = tl.sum(tl.where(picked, scores, 0.0), axis=1)  # the score itself: NaN stays NaN
        top = tl.where(slots[None, :] == k, weight[:, None], top)
        top_ids = tl.where(slots[None, :] == k, best_id[:, None], top_ids)
        rank = tl.where(picked, float("-inf"), rank)
    if NORMALIZE:
        top = top / (tl.sum(top, axis=1)[:, None] + 1e-20)
    if SCALE:
        top = top * scaling
    out = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    keep = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, top.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + out, top_ids.to(ids_ptr.dtype.element_ty), mask=keep)


def select_greedy(logits: torch.Tensor, top_k: int, normalize: bool, scale: bool, scaling_factor: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits → ([T, k] weights in `dtype`, [T, k] int64 expert ids): softmax in float32, the
    k largest scores, divided by their sum when `normalize`, times `scaling_factor` when `scale`."""
    tokens, num_experts = logits.shape
    if num_experts > MAX_EXPERTS or top_k > num_experts:
        raise ValueError(f"select_greedy takes up to {MAX_EXPERTS} experts and top_k <= experts; "
                         f"got {num_experts} experts, top_k {top_k}")
    logits = logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(64, 4096 // block_e))
    if tokens:
        _select_kernel[(triton.cdiv(tokens, block_t),)](
            logits, weights, ids, tokens, num_experts, logits.stride(0), float(scaling_factor), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), BLOCK_T=block_t, BLOCK_E=block_e, NORMALIZE=normalize, SCALE=scale,
            num_warps=4)
    return weights, ids
