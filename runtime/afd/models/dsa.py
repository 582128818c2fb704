"""DeepSeek Sparse Attention in plain torch: index scores, top-k key selection, attention over the chosen keys.

The lightning indexer scores every cached key of a sequence for each query token with a few small
heads (`index_scores`); each query then attends to its `topk` best-scored keys among those causality
allows (`chosen_keys`), all of them while a sequence holds no more than `topk`. These functions are
the CPU path and the reference the Triton kernels (`afd.kernels.sparse_mla`) are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCORE_ELEMENTS = 1 << 26  # [queries, index heads, keys] float32 elements scored at once (256 MiB)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Σ_h weights[.., h] · relu(scale · q[.., h] · key) for every (query, key): [..., T, L] float32.

    q [..., T, H, D] index queries; weights [..., T, H] their per-head weights; keys [..., L, D] index keys."""
    dots = torch.matmul(q.float(), keys.float().unsqueeze(-3).transpose(-1, -2))  # [..., T, H, L]
    return torch.matmul(weights.float().unsqueeze(-2), F.relu(dots * scale)).squeeze(-2)


def chosen_keys(scores: torch.Tensor, allowed: torch.Tensor, topk: int) -> torch.Tensor:
    """[..., T, L] bool: the `topk` best-scored of each query's `allowed` keys (all of them where it has no more)."""
    if scores.shape[-1] <= topk:
        return allowed
    picked = scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1).indices
    return torch.zeros_like(allowed).scatter_(-1, picked, True) & allowed


def prompt_choices(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float, topk: int) -> torch.Tensor:
    """[n, L] bool: the keys each of a prompt's last `n` positions attends to (q [n, H, D], weights [n, H], its
    index keys [L, D]), causal the lower-right way; scored `SCORE_ELEMENTS` at a time."""
    count, length = q.shape[0], keys.shape[0]
    rows = torch.arange(length - count, length, device=q.device)
    allowed = torch.arange(length, device=q.device)[None, :] <= rows[:, None]  # [n, L]
    if length <= topk:
        return allowed
    step = max(1, SCORE_ELEMENTS // (q.shape[1] * length))
    return torch.cat([chosen_keys(index_scores(q[i : i + step], weights[i : i + step], keys, scale),
                                  allowed[i : i + step], topk) for i in range(0, count, step)])


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Queries [n, H, Dk] over keys [L, Hkv, Dk] and values [L, Hkv, Dv] where `mask` [n, L] allows: [n, H, Dv]."""
    return F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0).to(q.dtype),
        values.transpose(0, 1).unsqueeze(0).to(q.dtype), attn_mask=mask.view(1, 1, *mask.shape), scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1],
    )[0].transpose(0, 1)
