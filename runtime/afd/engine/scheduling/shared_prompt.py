"""The choices of one prompt (`n` > 1, `best_of`) share its prefill and its full KV-cache blocks.

Requests submitted with one `group` and the same prompt: the first admitted (the leader) prefills
the prompt; one admitted with it, or while its prompt is still being fed, rides it (`ride`): it
feeds no token, and in the step that feeds the leader's last prompt chunk it samples its own first
token from the leader's logits row (its own seed stream, controls and grammar), then decodes on
its own. The prompt's full blocks are shared, with counted owners (the cache's `afd.kv.block_pool.BlockPool`: a block
is freed when its last owner finishes); the blocks past them are each request's own, and the partly filled
last prompt block is copied into the rider's own before its first decode step (`copy_tails`), so
no request ever writes into a block it shares. A leader that ends before its prompt is in hands
its riders to the first of them, which prefills (`hand_over`); so do riders put back to wait for a leader that
ended meanwhile, when launched steps are taken back (`rejoin`, hold and resume). A choice that finds no room beside
its leader runs as a request of its own (its own prefill), as before. The scheduler keeps the set of
requests with riders (`leaders`): with none, a step costs what it cost before.
"""

from __future__ import annotations

from typing import Sequence

import torch

from afd.engine.request import Request
from afd.models.kv_dtype import row_bytes
from afd.step.host_copy import host_to_device


def riding(request: Request) -> bool:
    """Waits for its leader's prefill: not scheduled on its own."""
    return request.shares is not None and request.cached_tokens < len(request.prompt_ids)


def leader_of(request: Request, running: Sequence[Request]) -> Request | None:
    """The running request of `request`'s group whose prompt is the same and still being fed, or None."""
    for other in reversed(running):
        if (other.group == request.group and other.shares is None and other.cached_tokens < len(other.prompt_ids)
                and other.prompt_ids == request.prompt_ids):
            return other
    return None


def shared_blocks(leader: Request, block_size: int) -> tuple[int, ...]:
    """The leader's blocks its prompt fills entirely: the ones its riders share."""
    return leader.blocks[: len(leader.prompt_ids) // block_size]


def ride(request: Request, leader: Request, blocks: tuple[int, ...], leaders: set[Request]) -> None:
    """`request` takes `leader`'s prefill, with `blocks` (the shared ones first, then its own)."""
    request.blocks, request.shares, request.chunk = blocks, leader, 0
    request.prompt_logprobs = leader.prompt_logprobs  # gathered once, over the leader's chunks
    leader.riders.append(request)
    leaders.add(leader)


def board(leader: Request, block_size: int, copies: list) -> list[Request]:
    """In the step that feeds `leader`'s last prompt chunk: its riders, whose prompt is in the cache from then on;
    the partly filled last prompt block (if any) is to be copied into each one's own before it decodes (`copies`
    gets (from block, to block, rows))."""
    prompt = len(leader.prompt_ids)
    boarding = [r for r in leader.riders if r.cached_tokens < prompt and not r.done]
    last, rows = divmod(prompt, block_size)
    for rider in boarding:
        rider.cached_tokens = prompt
        if rows:
            copies.append((leader.blocks[last], rider.blocks[last], rows))
    return boarding


def hand_over(leader: Request, leaders: set[Request], block_size: int = 0) -> None:
    """`leader` ends: its riders still waiting for its prefill ride the first of them, which prefills from the
    leader's published blocks on (prefix caching: never written again, others may share them) unless it asks for
    prompt logprobs."""
    waiting = [r for r in leader.riders if riding(r) and not r.done]
    leader.riders = []
    leaders.discard(leader)
    if not waiting:
        return
    first, rest = waiting[0], waiting[1:]
    first.shares, first.riders, first.prompt_logprobs = None, rest, []
    if leader.published and first.params.prompt_logprobs is None:
        first.published, first.prefix_hit = leader.published, leader.prefix_hit
        first.cached_tokens = min(leader.published * block_size, len(first.prompt_ids) - 1)
    for rider in rest:
        rider.shares, rider.prompt_logprobs = first, first.prompt_logprobs
    if rest:
        leaders.add(first)


def rejoin(running: Sequence[Request], leaders: set[Request], block_size: int = 0) -> None:
    """After launched steps are taken back (hold and resume): riders put back to wait for a prefill whose leader has
    ended meanwhile ride the first of them, which prefills (as `hand_over` does)."""
    live, orphans = set(running), {}
    for request in running:
        if riding(request) and request.shares not in live:
            orphans.setdefault(request.shares, []).append(request)
    for leader, riders in orphans.items():
        leader.riders = riders
        hand_over(leader, leaders, block_size)


def leave(request: Request, leaders: set[Request]) -> None:
    """`request` ends: it no longer rides its leader."""
    leader = request.shares
    if leader is not None and request in leader.riders:
        leader.riders.remove(request)
        if not leader.riders:
            leaders.discard(leader)


def copy_tails(kv_cache, copies: list[tuple[int, int, int]]) -> None:
    """Copy each (from block, to block, rows)'s first rows in every layer (device work, queued before the step that
    first writes the copies' blocks)."""
    if not copies:
        return
    size = kv_cache.block_size
    source = [src * size + i for src, _, rows in copies for i in range(rows)]
    target = [dst * size + i for _, dst, rows in copies for i in range(rows)]
    device = kv_cache.keys[0].device
    source, target = (host_to_device(torch.tensor(rows), device) for rows in (source, target))
    for rows in kv_cache.tensors():  # keys, values of their own, index keys
        rows = row_bytes(rows)  # an FP8 cache's rows move as bytes
        rows.index_copy_(0, target, rows.index_select(0, source))
