"""One attention rank's share of an offline batch: connect, generate greedily through the
serving Engine, disconnect.

Used by `afd generate` for every attention rank, in threads (loopback) or in
processes (zmq), so both paths run the same code.
"""

from __future__ import annotations

from typing import Sequence

from afd.config import AFDConfig
from afd.engine.offline import generate_with_engine
from afd.engine.generation import GenerationResult
from afd.kv.cache import DEFAULT_BLOCK_SIZE as KV_BLOCK_SIZE
from afd.roles.attention import build_attention


def split_prompts(num_prompts: int, num_ranks: int) -> list[list[int]]:
    """Prompt indices of each attention rank: contiguous, balanced blocks."""
    base, extra = divmod(num_prompts, num_ranks)
    blocks, start = [], 0
    for rank in range(num_ranks):
        size = base + (1 if rank < extra else 0)
        blocks.append(list(range(start, start + size)))
        start += size
    return blocks


def run_attention_batch(
    config: AFDConfig, prompts: Sequence[Sequence[int]], max_tokens: int, ignore_eos: bool
) -> GenerationResult:
    """Handshake with the FFN rank, decode `prompts` as one batch, say goodbye."""
    cache_tokens = sum(len(p) + max_tokens + KV_BLOCK_SIZE for p in prompts) or KV_BLOCK_SIZE
    role = build_attention(config, cache_tokens)
    try:
        if not prompts:
            return GenerationResult([], [])
        return generate_with_engine(
            role.runner, role.kv_cache, prompts, max_tokens, role.loaded.spec.eos_token_ids, ignore_eos, role.device,
            link=role.link,
        )
    finally:
        role.close("batch finished")
