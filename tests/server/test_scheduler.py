"""Admission control: limits are respected, nothing is dropped, order is first come first served."""

import torch

from afd.engine.request import Request, SamplingParams
from afd.engine.scheduler import Scheduler
from afd.kv_cache import KVCache
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
