"""Continuous batching with admission control: FIFO, never drops, never over-commits the cache.

Every step, the running requests each decode one token, prompts being prefilled take
their next chunk, and waiting requests join while there is room: fewer than `max_num_seqs`
running, the step's token budget (chunked prefill), and KV-cache blocks for the request's worst case
(prompt + max_tokens, capped by the context length). Reserving the worst case at
admission means a running request never has to be preempted. Admission is strictly
first-come-first-served: a large request at the head is not overtaken. With a `PrefillPacer`,
a step that has decodes takes only as many prompt tokens as keep it within the pacer's
multiple of a decode-only step, but enough that every prompt is in within `prefill_backlog_steps` steps of being
queued (`afd.engine.scheduling.step_cost`). The choices of one prompt are admitted together where the cache allows and
share its prefill and full blocks (`afd.engine.scheduling.shared_prompt`). With `prefix_caching`, a request admitted
shares the cached blocks of its prompt's longest published prefix and is prefilled from there
(`afd.engine.scheduling.prefix_hits`); blocks are counted and cached by the cache's pool (`afd.kv.block_pool`).
"""

from __future__ import annotations

from collections import deque
from itertools import islice

from afd.engine.request import InvalidRequest, Request
from afd.engine.scheduling import prefix_hits
from afd.engine.scheduling.shared_prompt import hand_over, leader_of, leave, rejoin, ride, riding, shared_blocks
from afd.engine.scheduling.step_cost import PrefillPacer
from afd.kv.cache import KVCache


class Scheduler:
    def __init__(self, kv_cache: KVCache, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 pacer: PrefillPacer | None = None, prefix_caching: bool = False):
        self.kv_cache = kv_cache
        self.blocks = kv_cache.pool  # blocks with counted owners (choices of one prompt, cached prefixes), cached ones
        self.prefix_caching = prefix_caching
        self.prefix_counts = prefix_hits.PrefixCounts()
        self.leaders: set[Request] = set()  # running requests whose prefill others ride (`afd.engine.scheduling.shared_prompt`)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.pacer = pacer  # None: prompts take all the budget the decodes leave
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.steps = 0  # schedule() calls so far: prompts' prefill deadlines count in them

    def reserved_tokens(self, request: Request) -> int:
        return min(len(request.prompt_ids) + request.params.max_tokens, self.max_model_len)

    def check(self, request: Request) -> Request:
        """`request` if it can ever run here, else `InvalidRequest` saying why."""
        prompt = len(request.prompt_ids)
        if not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        if prompt >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {prompt} tokens; this model's context is {self.max_model_len} "
                                 f"tokens, leaving no room to generate", "prompt")
        if self.kv_cache.blocks_for(self.reserved_tokens(request)) > self.kv_cache.num_blocks:
            raise InvalidRequest(f"prompt + max_tokens needs {self.reserved_tokens(request)} tokens of KV cache; "
                                 f"this server holds {self.kv_cache.capacity_tokens}", "max_tokens")
        return request

    def add(self, request: Request) -> None:
        request.queued_step = self.steps
        self.waiting.append(request)

    def schedule(self) -> list[Request]:
        """Requests to run this step, running ones first; admitted ones get their blocks.

        Decoding requests take one token each; prompts are fed in chunks (`request.chunk`
        tokens this step) within what is left of the step's token budget, so a long prompt
        shares steps with running decodes instead of stalling them. A running request whose
        last token is already in a launched step (`final_scheduled`) keeps its seat and
        blocks until that step's result is in, but is not scheduled again. With decodes in the
        step, the pacer (if any) caps the prompt tokens.
        """
        batch = [r for r in self.running if not r.final_scheduled]
        if self.leaders:  # riders wait for their leader's prefill
            batch = [r for r in batch if r.shares is None or not riding(r)]
        prefilling = [r for r in batch if r.cached_tokens < len(r.prompt_ids)]
        decodes = len(batch) - len(prefilling)
        budget = self.max_num_batched_tokens - decodes
        if decodes and self.pacer is not None and (prefilling or self.waiting):
            cap = self.pacer.prefill_cap(decodes, self._backlog(prefilling))
            budget = budget if cap is None else min(budget, cap)
        if prefilling:
            batch = [r for r in batch if r.cached_tokens >= len(r.prompt_ids)]
            for request in prefilling:  # oldest first: a started prompt finishes before a new one starts
                if budget <= 0:
                    break
                request.chunk = min(len(request.prompt_ids) - request.cached_tokens, budget)
                batch.append(request)
                budget -= request.chunk
        while self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            leader = leader_of(head, self.running) if head.group is not None else None
            if leader is not None:  # it rides the leader's prefill: no prompt token of its own this step
                shared = shared_blocks(leader, self.kv_cache.block_size)
                own = self.reserved_tokens(head) - len(shared) * self.kv_cache.block_size
                if not self.blocks.can_allocate(own):
                    break
                self.blocks.share(shared)
                ride(head, leader, shared + tuple(self.blocks.allocate(own)), self.leaders)
                self.running.append(self.waiting.popleft())
                continue
            if budget <= 0 or not self._admit(head):
                break
            head.chunk = min(len(head.prompt_ids) - head.cached_tokens, budget)
            self.waiting.popleft()
            self.running.append(head)
            batch.append(head)
            budget -= head.chunk
        self.steps += 1
        return batch

    def _admit(self, head: Request) -> bool:
        """Give `head` its blocks (cached ones of its prefix first, shared), or False: too few are free."""
        cached = prefix_hits.lookup(self.blocks, head) if self.prefix_caching else []
        self.blocks.share(cached)  # before allocating: no longer free, they cannot be evicted for head's own
        own = self.reserved_tokens(head) - len(cached) * self.kv_cache.block_size
        if not self.blocks.can_allocate(own):
            self.blocks.release(cached)
            return False
        head.blocks = tuple(cached) + tuple(self.blocks.allocate(own))
        if self.prefix_caching:
            prefix_hits.hit(head, cached, self.kv_cache.block_size, self.prefix_counts)
        return True

    def publish(self, written) -> None:
        """A committed step wrote these (request, prompt position) (`afd.engine.scheduling.prefix_hits.publish`)."""
        if self.prefix_caching and written:
            prefix_hits.publish(self.blocks, written)

    def _backlog(self, prefilling: list[Request]) -> list[tuple[int, int]]:
        """(prompt tokens left, steps scheduled since queued) of the running prompts and of the waiting ones that
        have a seat, oldest first."""
        seated = islice(self.waiting, max(0, self.max_num_seqs - len(self.running)))
        return ([(len(r.prompt_ids) - r.cached_tokens, self.steps - r.queued_step) for r in prefilling]
                + [(len(r.prompt_ids), self.steps - r.queued_step) for r in seated])  # before any cache hit

    def finish(self, request: Request) -> None:
        """Remove a running or waiting request and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.riders:
            hand_over(request, self.leaders, self.kv_cache.block_size)
        if request.shares is not None:
            leave(request, self.leaders)
        if request.blocks:
            self.blocks.release(request.blocks)
            request.blocks = ()

    def taken_back(self) -> None:
        """Launched steps were taken back (hold and resume): riders waiting again for a leader that ended meanwhile
        ride the first of them (`afd.engine.scheduling.shared_prompt.rejoin`)."""
        rejoin(self.running, self.leaders, self.kv_cache.block_size)

    def abort(self, request_ids: set[str]) -> list[Request]:
        """End and free the running or waiting requests of `request_ids` (tokens already launched are dropped)."""
        aborted = [r for r in list(self.running) + list(self.waiting) if r.request_id in request_ids]
        for request in aborted:
            request.done = True
            self.finish(request)
        return aborted
