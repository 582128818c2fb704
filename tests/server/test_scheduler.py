"""Admission control: limits are respected, nothing is dropped, order is first come first served; the prefill pacer's
cap holds next to decodes without starving prompts."""

import torch

from afd.engine.request import Request, SamplingParams
from afd.engine.scheduling.scheduler import Scheduler
from afd.engine.scheduling.step_cost import PrefillPacer, StepCostModel
from afd.kv.cache import KVCache
from afd.models.spec import KVLayout


def make(prompt_len, max_tokens=8):
    return Request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), lambda out: None)


def scheduler(blocks=8, max_num_seqs=4, budget=64):
    cache = KVCache([KVLayout(1, 2, 2)], blocks, torch.float32, "cpu", block_size=4)
    return Scheduler(cache, max_num_seqs, budget, max_model_len=64)


def test_new_requests_join_the_running_batch():
    sched = scheduler()
    first = make(4)
    sched.add(first)
    assert sched.schedule() == [first]
    second = make(4)
    sched.add(second)
    assert sched.schedule() == [first, second]


def test_max_num_seqs_limits_the_batch_and_the_rest_wait():
    sched = scheduler(blocks=64, max_num_seqs=2)
    requests = [make(2) for _ in range(3)]
    for r in requests:
        sched.add(r)
    assert sched.schedule() == requests[:2] and list(sched.waiting) == requests[2:]
    sched.finish(requests[0])
    assert sched.schedule() == [requests[1], requests[2]]


def test_over_kv_capacity_a_request_waits_and_is_admitted_later():
    sched = scheduler(blocks=6)  # 24 tokens; each request reserves 4 + 8 = 12 tokens = 3 blocks
    a, b, c = make(4), make(4), make(4)
    for r in (a, b, c):
        sched.add(r)
    assert sched.schedule() == [a, b]
    assert list(sched.waiting) == [c] and sched.kv_cache.free_blocks == 0
    sched.finish(a)
    assert sched.schedule() == [b, c]


def test_first_come_first_served_no_overtaking():
    sched = scheduler(blocks=6)
    big, small = make(12, max_tokens=8), make(1, max_tokens=1)  # big needs 5 blocks, small 1
    holder = make(4)
    sched.add(holder)
    sched.schedule()  # holder takes 3 blocks; 3 left
    sched.add(big)
    sched.add(small)
    assert sched.schedule() == [holder]  # small fits but must not overtake big
    sched.finish(holder)
    assert sched.schedule() == [big, small]


def test_token_budget_chunks_prompts_and_decodes_go_first():
    sched = scheduler(blocks=64, budget=10)
    a, b = make(8), make(8)
    sched.add(a)
    sched.add(b)
    assert sched.schedule() == [a, b] and (a.chunk, b.chunk) == (8, 2)  # b's prompt starts in what is left
    a.cached_tokens, b.cached_tokens = 8, 2  # what the engine does when it launches the step
    c = make(30)
    sched.add(c)
    assert sched.schedule() == [a, b, c] and (b.chunk, c.chunk) == (6, 3)  # a decodes (1), b goes on, c starts
    b.cached_tokens, c.cached_tokens = 8, 3
    assert sched.schedule() == [a, b, c] and c.chunk == 8  # two decodes, the rest of the budget to c


def test_finish_frees_blocks():
    sched = scheduler()
    r = make(4)
    sched.add(r)
    sched.schedule()
    assert sched.kv_cache.free_blocks == 5
    sched.finish(r)
    assert sched.kv_cache.free_blocks == 8 and not sched.running


def paced(budget=2048, ratio=2.0, min_tokens=32, learn=True, backlog_steps=16):
    """A scheduler whose pacer learned steps of 10 ms + 10 µs per token (2 × a decode step of d: 1000 + d prompt tokens);
    a backlog floor of 1/16 (the default is 1/64) keeps the arithmetic small."""
    cache = KVCache([KVLayout(1, 2, 2)], 4096, torch.float32, "cpu", block_size=16)
    cost = StepCostModel()
    for tokens in (8, 16, 64, 256, 1024, 2048) * 3 if learn else ():
        cost.observe(tokens, 0.010 + 10e-6 * tokens)
    return Scheduler(cache, 64, budget, max_model_len=4096, pacer=PrefillPacer(ratio, min_tokens, cost, backlog_steps, decode_cost=cost))


def run_step(batch):
    """What the engine does when it launches a step: prompts advance by their chunk, decodes by one token."""
    for request in batch:
        prefilling = request.cached_tokens < len(request.prompt_ids)
        request.cached_tokens += request.chunk if prefilling else 1


def decoding(sched, count):
    requests = [make(4, max_tokens=1000) for _ in range(count)]
    for r in requests:
        sched.add(r)
    run_step(sched.schedule())
    return requests


def test_with_decodes_prompts_are_capped_every_decode_still_runs_and_every_prompt_finishes():
    sched = paced()
    decodes = decoding(sched, 16)  # a decode-only step: 10.16 ms; 2 × that holds 1,032 tokens, 1,016 of them prompt
    prompts = [make(1500, max_tokens=4) for _ in range(3)]
    for p in prompts:
        sched.add(p)
    steps = 0
    while any(p.cached_tokens < len(p.prompt_ids) for p in prompts):
        batch = sched.schedule()
        chunks = sum(r.chunk for r in batch if r.cached_tokens < len(r.prompt_ids))
        running = len(batch) - sum(r.cached_tokens < len(r.prompt_ids) for r in batch)  # 16, then finished prompts
        assert all(d in batch for d in decodes)  # the decodes are never squeezed out
        assert sched.pacer.min_tokens <= chunks <= 1000 + running  # the cap, never below the minimum
        assert sched.pacer.cost.predict(running + chunks) <= 2.0 * sched.pacer.cost.predict(running) * 1.001
        run_step(batch)
        steps += 1
    assert steps == 9  # 4,500 prompt tokens at ~508 a step, aiming at 0.75 × the ratio (uncapped: 3 steps of 2,032)


def test_the_cap_never_starves_prompts():
    sched = paced(ratio=1.0, min_tokens=32)  # a mixed step may not be longer at all: the minimum chunk still goes in
    decoding(sched, 16)
    prompt = make(100, max_tokens=4)
    sched.add(prompt)
    chunks = []
    while prompt.cached_tokens < 100:
        batch = sched.schedule()
        chunks.append(prompt.chunk)
        run_step(batch)
    assert chunks == [32, 32, 32, 4]


def test_without_decodes_prompts_take_the_whole_budget():
    sched = paced()
    prompt = make(3000, max_tokens=4)
    sched.add(prompt)
    assert sched.schedule() == [prompt] and prompt.chunk == 2048


def _chunks_of(sched):
    decoding(sched, 8)
    prompts = [make(700 + 300 * i, max_tokens=4) for i in range(4)]
    seen = []
    for p in prompts:
        sched.add(p)
    while any(p.cached_tokens < len(p.prompt_ids) for p in prompts):
        batch = sched.schedule()
        seen.append([(len(r.prompt_ids), r.chunk) for r in batch])
        run_step(batch)
    return seen


def test_a_pacer_that_learned_nothing_gives_prompts_beside_decodes_only_the_backlog_floor():
    """The first prompts of a run arrive together: before the cost is learned, a step beside decodes takes
    1/16 of the waiting prompt tokens (no pacer: the whole budget, a gap several decode steps long)."""
    unpaced = paced()
    unpaced.pacer = None
    assert sum(chunk for _, chunk in _chunks_of(unpaced)[0][8:]) == 2048 - 8
    steps = _chunks_of(paced(learn=False))
    assert [chunk for _, chunk in steps[0][8:]] == [-(-(700 + 1000 + 1300 + 1600) // 16)]
    assert all(sum(chunk for _, chunk in step[8:]) <= 2048 - 8 for step in steps)


def test_a_burst_beside_decodes_too_short_for_any_chunk_takes_the_whole_budget_until_the_decodes_outnumber_it():
    sched = paced(ratio=1.0)  # beside decodes no prompt token fits the ratio: capped, the prompts would get the floor
    decoding(sched, 3)
    prompts = [make(600, max_tokens=4) for _ in range(13)]  # 16 streams: 3 decoding, 13 waiting for a first token
    for p in prompts:
        sched.add(p)
    steps = []
    while any(p.cached_tokens < len(p.prompt_ids) for p in prompts):
        batch = sched.schedule()
        steps.append(sum(r.chunk for r in batch if r.cached_tokens < len(r.prompt_ids)))
        run_step(batch)
    # 3 decoding, 13 waiting: the whole budget; 6 decoding, 10 waiting: the whole budget; 9 decoding, 7 waiting:
    # capped, the floor: the 3,713 tokens left over the 14 steps left before the burst's deadline
    assert steps[:3] == [2048 - 3, 2048 - 6, 266]
    assert len(steps) <= 16
    assert sched.pacer.prefill_cap(3, [(600, 0)] * 3) is None and sched.pacer.prefill_cap(4, [(600, 0)] * 3) == 113
    # where a chunk fits the ratio, a burst is capped like any step: 0.75 × 2 × the smallest step learned (8 tokens,
    # 10.08 ms) holds 512 tokens, 3 of them decodes
    assert paced().pacer.prefill_cap(3, [(600, 0)] * 13) == 509


def test_prompts_piling_up_behind_the_cap_take_a_share_of_the_backlog_each_step():
    sched = paced(ratio=1.0)  # the ratio alone would let only 32 prompt tokens a step in
    decoding(sched, 16)
    prompts = [make(1600, max_tokens=4) for _ in range(4)]
    for p in prompts:
        sched.add(p)
    first = sched.schedule()
    assert sum(r.chunk for r in first if r in prompts) == 400  # 6,400 waiting tokens / 16
    run_step(first)
    steps = 1
    while any(p.cached_tokens < len(p.prompt_ids) for p in prompts):
        run_step(sched.schedule())
        steps += 1
    assert steps < 80  # geometric while the backlog is large, then 32 a step; 200 steps at 32 alone
