"""Automatic prefix caching: a request's prompt starts at its first uncached token, and the full prompt blocks a
committed step wrote are published for later requests (`afd.kv.block_pool`, named by `afd.kv.block_hash`).

At admission (`hit`) the longest published prefix of the prompt's full blocks is shared (one more owner each) and
the prefill starts after it; at least the last prompt token is computed (its logits give the first output token),
so a hit never covers the block holding it: no request writes into a block it shares. A request asking for prompt
logprobs looks nothing up: every prompt position's logits are computed (exact, at the price of its prefill).
A step's prompt blocks are published only when its tokens are read (`publish`, from the engine's drain): a step
taken back (hold and resume) or failed never publishes, and a request already ended publishes nothing.
Only prompt blocks are named (a resumed request's prompt holds the tokens carried from its earlier rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from afd.engine.request import Request
from afd.kv.block_hash import block_hashes
from afd.kv.block_pool import BlockPool


@dataclass
class PrefixCounts:
    """Prompt tokens looked up and found cached since start (`afd_prefix_cache_queries_total`, `_hits_total`)."""

    queries: int = 0
    hits: int = 0


def names_of(request: Request, block_size: int) -> list[bytes]:
    """The names of `request`'s full prompt blocks (worked out once)."""
    if request.block_names is None:
        request.block_names = block_hashes(request.prompt_ids, block_size, request.params.cache_salt)
    return request.block_names


def lookup(pool: BlockPool, request: Request) -> list[int]:
    """The cached blocks `request`'s prompt may start after: never the one holding its last token, none when it asks
    for prompt logprobs."""
    if request.params.prompt_logprobs is not None:
        return []
    usable = (len(request.prompt_ids) - 1) // pool.block_size
    if usable == 0:
        return []
    return pool.lookup(names_of(request, pool.block_size)[:usable])


def hit(request: Request, cached: Sequence[int], block_size: int, counts: PrefixCounts) -> None:
    """`request` was admitted with the shared `cached` blocks first in its table: its prefill starts after them."""
    request.cached_tokens = request.prefix_hit = len(cached) * block_size
    request.published = len(cached)
    counts.queries += len(request.prompt_ids)
    counts.hits += request.prefix_hit


def publish(pool: BlockPool, written: Sequence[tuple[Request, int]]) -> None:
    """A committed step wrote each request's prompt up to the given position: its full blocks are published."""
    size = pool.block_size
    for request, upto in written:
        full = min(upto, len(request.prompt_ids)) // size
        if full <= request.published or not request.blocks or request.shares is not None:
            continue
        names = names_of(request, size)
        for index in range(request.published, full):
            pool.publish(request.blocks[index], names[index])
        request.published = full
