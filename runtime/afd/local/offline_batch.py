"""One attention rank's share of an offline batch: a KV cache that holds it, greedy generation through the
serving Engine on the connected rank, then disconnect.

Used by `afd generate` for every attention rank, in threads (loopback) or in
processes (zmq), so both paths run the same code.
"""

from __future__ import annotations

from typing import Sequence

from afd.engine.offline import generate_with_engine
from afd.engine.generation import GenerationResult
from afd.kv.cache import DEFAULT_BLOCK_SIZE as KV_BLOCK_SIZE


def split_prompts(num_prompts: int, num_ranks: int) -> list[list[int]]:
    """Prompt indices of each attention rank: contiguous, balanced blocks."""
    base, extra = divmod(num_prompts, num_ranks)
    blocks, start = [], 0
    for rank in range(num_ranks):
        size = base + (1 if rank < extra else 0)
        blocks.append(list(range(start, start + size)))
        start += size
    return blocks


def batch_cache_tokens(prompts: Sequence[Sequence[int]], max_tokens: int) -> int:
    """KV-cache tokens that hold every prompt of a batch with `max_tokens` outputs each."""
    return sum(len(p) + max_tokens + KV_BLOCK_SIZE for p in prompts) or KV_BLOCK_SIZE


def run_attention_batch(role, prompts: Sequence[Sequence[int]], max_tokens: int, ignore_eos: bool) -> GenerationResult:
    """Decode `prompts` as one batch on `role`, an attention rank handshaken with its FFN rank
    (`afd.roles.build_attention` with a cache of `batch_cache_tokens`), then say goodbye."""
    try:
        if not prompts:
            return GenerationResult([], [])
        return generate_with_engine(
            role.runner, role.kv_cache, prompts, max_tokens, role.loaded.spec.eos_token_ids, ignore_eos, role.device,
            link=role.link,
        )
    finally:
        role.close("batch finished")
