"""The pure logic of prefix caching: block names (hash chain, salt), the block pool (counted owners, cached free
blocks evicted least recently used), admission hits and publishing only what a read step wrote."""

import pytest
import torch

from afd.engine.request import Request, SamplingParams
from afd.engine.scheduling.scheduler import Scheduler
from afd.kv.block_hash import block_hashes
from afd.kv.block_pool import BlockPool, CacheFullError
from afd.kv.cache import KVCache
from afd.models.spec import KVLayout


def test_block_names_chain_over_the_prefix_and_the_salt():
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2  # the partly filled third block has no name
    assert block_hashes(list(range(8)), 4) == a  # the same prefix, the same names
    other_first = block_hashes([99] + list(range(1, 10)), 4)
    assert other_first[0] != a[0] and other_first[1] != a[1]  # a block's name depends on every block before it
    assert block_hashes(list(range(10)), 4, "tenant") != a  # salted: no block shared with the unsalted chain
    assert block_hashes(list(range(10)), 4, "tenant") == block_hashes(list(range(10)), 4, "tenant")
    assert block_hashes(list(range(10)), 4, "tenant")[1] != block_hashes(list(range(10)), 4, "other")[1]


def test_owners_share_and_release_and_published_blocks_stay_cached():
    pool = BlockPool(4, 2)
    first = pool.allocate(4)  # 2 blocks
    pool.publish(first[0], b"a")
    pool.share(first)  # a second owner of each
    pool.release(first)
    assert pool.free_blocks == 2 and pool.shared == 0
    pool.release(first)
    assert pool.free_blocks == 4  # the published block counts as free
    assert pool.lookup([b"a", b"b"]) == [first[0]]  # and is still found
    pool.share([first[0]])  # a hit: its first owner again
    assert pool.free_blocks == 3 and pool.lookup([b"a"]) == [first[0]]
    pool.release([first[0]])
    assert pool.free_ids() == [0, 1, 2, 3]


def test_never_published_blocks_go_first_then_cached_ones_least_recently_released_first():
    pool = BlockPool(4, 1)
    blocks = pool.allocate(4)
    for block, name in zip(blocks, (b"a", b"b", b"c")):
        pool.publish(block, name)
    pool.release(blocks[2:3])  # c: released first, evicted first
    pool.release(blocks[:2])  # a and b: the table's last block (b) is evicted before its first (a)
    pool.release(blocks[3:])  # never published: handed out before any cached block
    assert pool.allocate(1) == [blocks[3]] and pool.lookup([b"a", b"b", b"c"]) == blocks[:3]
    assert pool.allocate(2) == [blocks[2], blocks[1]]  # c, then b: their names are forgotten
    assert pool.lookup([b"a", b"b"]) == [blocks[0]] and pool.cached_blocks == 1
    with pytest.raises(CacheFullError):
        pool.allocate(2)


def test_a_name_already_published_keeps_its_block():
    pool = BlockPool(2, 1)
    x, y = pool.allocate(2)
    pool.publish(x, b"n")
    pool.publish(y, b"n")  # computed twice by two requests at once: the first stays
    assert pool.lookup([b"n"]) == [x]
    pool.release([y])
    assert pool.cached_blocks == 1 and pool.free_blocks == 1


def scheduler(blocks=16, budget=64, caching=True):
    cache = KVCache([KVLayout(1, 2, 2)], blocks, torch.float32, "cpu", block_size=4)
    return Scheduler(cache, 8, budget, max_model_len=64, prefix_caching=caching)


def request(prompt, max_tokens=4, **params):
    return Request(list(prompt), SamplingParams(max_tokens=max_tokens, **params), lambda out: None)


def run_prompt(sched, req):
    """Admit `req`, feed its whole prompt in one step whose tokens are read (published), finish it."""
    sched.add(req)
    assert req in sched.schedule()
    req.cached_tokens += req.chunk
    sched.publish([(req, req.cached_tokens)])
    sched.finish(req)


def test_a_prompt_starts_after_its_cached_full_blocks_and_never_reuses_the_block_of_its_last_token():
    sched = scheduler()
    run_prompt(sched, request(range(1, 11)))  # 2 full blocks published
    again = request(range(1, 13))  # 12 tokens: 3 full blocks, the third not cached
    sched.add(again)
    sched.schedule()
    assert (again.cached_tokens, again.prefix_hit, again.chunk) == (8, 8, 4)
    whole = request(range(1, 9))  # 8 tokens, both blocks cached: the block of its last token is computed again
    sched.add(whole)
    sched.schedule()
    assert (whole.cached_tokens, whole.chunk) == (4, 4)
    assert whole.blocks[0] == again.blocks[0] and whole.blocks[1] != again.blocks[1]
    assert sched.prefix_counts.queries == 10 + 12 + 8 and sched.prefix_counts.hits == 8 + 4


def test_unpublished_steps_salts_prompt_logprobs_and_caching_off_find_nothing():
    sched = scheduler()
    taken_back = request(range(1, 11))
    sched.add(taken_back)
    sched.schedule()
    sched.finish(taken_back)  # its step was never read: nothing published
    probe = request(range(1, 11))
    sched.add(probe)
    sched.schedule()
    assert probe.prefix_hit == 0
    probe.cached_tokens = 10
    sched.publish([(probe, 10)])
    sched.finish(probe)
    for other in (request(range(1, 11), cache_salt="s"), request(range(1, 11), prompt_logprobs=1)):
        sched.add(other)
        sched.schedule()
        assert other.prefix_hit == 0
        sched.finish(other)
    hit = request(range(1, 11))
    sched.add(hit)
    sched.schedule()
    assert hit.prefix_hit == 8
    off = scheduler(caching=False)
    run_prompt(off, request(range(1, 11)))
    again = request(range(1, 11))
    off.add(again)
    off.schedule()
    assert again.prefix_hit == 0 and off.kv_cache.pool.cached_blocks == 0


def test_cached_blocks_make_room_for_new_prompts_and_hits_keep_theirs():
    sched = scheduler(blocks=6)
    run_prompt(sched, request(range(1, 13), max_tokens=8))  # 3 full blocks cached, all 6 free
    assert sched.kv_cache.free_blocks == 6 and sched.kv_cache.usage == 0
    hit = request(range(1, 13), max_tokens=8)  # 2 blocks hit, 3 of its own (12 + 8 tokens = 5 blocks)
    sched.add(hit)
    sched.schedule()
    assert hit.prefix_hit == 8 and sched.kv_cache.free_blocks == 1
    other = request(range(100, 103), max_tokens=1)  # takes the last free block: an evicted cached one or a fresh one
    sched.add(other)
    assert other in sched.schedule() and sched.kv_cache.free_blocks == 0
    assert set(hit.blocks).isdisjoint(other.blocks)


def test_a_hit_that_leaves_too_little_room_waits_and_gives_its_cached_blocks_back():
    sched = scheduler(blocks=4)
    run_prompt(sched, request(range(1, 9), max_tokens=1))  # 2 full blocks cached
    holder = request(range(50, 54), max_tokens=4)  # 2 blocks, never published
    sched.add(holder)
    sched.schedule()
    big = request(range(1, 9), max_tokens=8)  # hits 1 block, needs 3 more: only 1 free besides the hit
    sched.add(big)
    assert big not in sched.schedule() and list(sched.waiting) == [big]
    assert sched.kv_cache.free_blocks == 2 and sched.kv_cache.pool.lookup(big.block_names[:1])


def test_a_choice_that_takes_over_an_ended_leaders_prefill_starts_after_its_published_blocks():
    sched = scheduler(budget=5)
    leader, rider = request(range(1, 11)), request(range(1, 11))
    leader.group = rider.group = "g"
    sched.add(leader)
    sched.add(rider)
    assert sched.schedule() == [leader] and rider.shares is leader and leader.chunk == 5
    leader.cached_tokens += leader.chunk
    sched.publish([(leader, leader.cached_tokens)])  # its first block is written for good (and may be shared)
    sched.finish(leader)  # ended mid-prefill: the rider prefills, from the published block on
    assert rider.shares is None and (rider.cached_tokens, rider.published) == (4, 1)
    assert sched.schedule() == [rider] and rider.chunk == 5
    off = scheduler(budget=5, caching=False)  # without prefix caching nothing is published: it starts from 0
    leader, rider = request(range(1, 11)), request(range(1, 11))
    leader.group = rider.group = "g"
    off.add(leader)
    off.add(rider)
    off.schedule()
    leader.cached_tokens += leader.chunk
    off.publish([(leader, leader.cached_tokens)])
    off.finish(leader)
    assert rider.shares is None and rider.cached_tokens == 0
