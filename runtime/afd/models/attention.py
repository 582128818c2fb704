"""Batched attention over a slot-based KV cache, for prefill and decode in one step.

A step's tokens arrive flattened ([T, ...]); `AttentionBatch` says which sequence
(cache slot) and position each token has. The kernel writes the new keys and values
into the cache, gathers each sequence's keys into a padded batch and runs one SDPA
with a causal, length-aware mask. No Python loop over tokens or sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionBatch:
    """Where each flattened token of a step sits: sequence, cache slot and position."""

    positions: torch.Tensor  # [T] absolute position of each token
    token_slot: torch.Tensor  # [T] cache slot of each token's sequence
    token_seq: torch.Tensor  # [T] index of each token's sequence in this batch
    token_col: torch.Tensor  # [T] index of each token among its sequence's new tokens
    slots: torch.Tensor  # [B] cache slot of each sequence
    mask: torch.Tensor  # [B, 1, max_new, max_len] True where a query may attend
    last_token: torch.Tensor  # [B] flat index of each sequence's last new token
    max_len: int
    max_new: int

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.slots.shape[0])

    @classmethod
    def build(
        cls,
        slots: Sequence[int],
        context_lens: Sequence[int],
        new_lens: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> "AttentionBatch":
        """Metadata for sequences in `slots` that already cached `context_lens` tokens and add `new_lens`."""
        if not (len(slots) == len(context_lens) == len(new_lens)) or not slots:
            raise ValueError("an attention batch needs one slot, context length and new length per sequence")
        if min(new_lens) < 1:
            raise ValueError("every sequence in a step must add at least one token")
        new = torch.tensor(new_lens, dtype=torch.long)
        context = torch.tensor(context_lens, dtype=torch.long)
        token_seq = torch.repeat_interleave(torch.arange(len(slots)), new)
        starts = torch.cumsum(new, 0) - new
        token_col = torch.arange(int(new.sum())) - starts[token_seq]
        positions = context[token_seq] + token_col
        total = context + new
        max_len, max_new = int(total.max()), int(new.max())
        query_pos = context[:, None] + torch.arange(max_new)[None, :]  # [B, max_new]
        key_pos = torch.arange(max_len)
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < total[:, None, None])
        slot_tensor = torch.tensor(slots, dtype=torch.long)
        return cls(
            positions=positions.to(device),
            token_slot=slot_tensor[token_seq].to(device),
            token_seq=token_seq.to(device),
            token_col=token_col.to(device),
            slots=slot_tensor.to(device),
            mask=mask.unsqueeze(1).to(device),
            last_token=(starts + new - 1).to(device),
            max_len=max_len,
            max_new=max_new,
        )


def cached_attention(
    q: torch.Tensor,  # [T, Hq, Dk]
    k: torch.Tensor,  # [T, Hkv, Dk]
    v: torch.Tensor,  # [T, Hkv, Dv]
    cache_k: torch.Tensor,  # [slots, max_model_len, Hkv, Dk]
    cache_v: torch.Tensor,  # [slots, max_model_len, Hkv, Dv]
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """Store k/v at their positions, then attend each query to its sequence's cache: [T, Hq, Dv]."""
    cache_k[batch.token_slot, batch.positions] = k.to(cache_k.dtype)
    cache_v[batch.token_slot, batch.positions] = v.to(cache_v.dtype)
    keys = cache_k[batch.slots, : batch.max_len].transpose(1, 2)  # [B, Hkv, L, Dk]
    values = cache_v[batch.slots, : batch.max_len].transpose(1, 2)  # [B, Hkv, L, Dv]
    padded_q = q.new_zeros(batch.num_seqs, batch.max_new, *q.shape[1:])
    padded_q[batch.token_seq, batch.token_col] = q
    out = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2),
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=batch.mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # [B, Hq, max_new, Dv]
    return out.transpose(1, 2)[batch.token_seq, batch.token_col]
