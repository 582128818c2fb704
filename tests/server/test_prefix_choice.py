"""The front door's rank choice: the rank holding a request's prefix, bounded by load; else the least loaded, in turn."""

from __future__ import annotations

import pytest

from afd.server.front.prefix_choice import (
    ChoiceSettings, Chooser, PrefixMap, RankLoad, chunk_hashes, choose, prompt_text, request_hashes,
)
from afd.server.front.rank_watch import RankWatch, gauges

A, B, C = "http://a", "http://b", "http://c"
SYSTEM = "You are a careful assistant. " * 40  # ~1,100 characters: 9 chunks of 128


def chat(*contents: str, salt: str | None = None) -> dict:
    body = {"model": "m", "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": c}
                                       for i, c in enumerate(contents)]}
    return body if salt is None else {**body, "cache_salt": salt}


def test_the_hash_chain_names_whole_chunks_each_after_everything_before_it():
    one = chunk_hashes("x" * 300, chunk_chars=128)
    assert len(one) == 2  # the partial third chunk is left out
    assert chunk_hashes("y" + "x" * 299, chunk_chars=128)[1] != one[1]  # a later chunk depends on the first
    assert chunk_hashes("x" * 256 + "z" * 44, chunk_chars=128) == one
    assert chunk_hashes("x" * 300, seed="other model", chunk_chars=128)[0] != one[0]
    assert len(chunk_hashes("x" * 10_000, chunk_chars=10, max_chunks=7)) == 7


def test_requests_are_keyed_by_their_leading_text_model_and_salt():
    first = request_hashes("/v1/chat/completions", chat(SYSTEM, "what is AFD?"))
    follow_up = request_hashes("/v1/chat/completions", chat(SYSTEM, "what is AFD?", "It is ...", "and MoE?"))
    assert len(first) >= 8 and follow_up[:len(first)] == first  # a conversation extends its own chain
    assert request_hashes("/v1/chat/completions", chat(SYSTEM, "what is AFD?", salt="tenant-a"))[0] != first[0]
    assert request_hashes("/v1/chat/completions", {**chat(SYSTEM), "model": "n"})[0] != first[0]
    assert prompt_text("/v1/completions", {"prompt": ["abc", "def"]}) == "abc"
    assert prompt_text("/v1/completions", {"prompt": [1, 2, 3]}) == "1,2,3"
    assert prompt_text("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]}]}) == "\x1euser\x1fhi there"
    assert prompt_text("/v1/models", {}) is None and request_hashes("/v1/completions", "not a dict") == []


def test_the_map_finds_the_longest_chain_per_rank_and_forgets_the_oldest_first():
    prefixes = PrefixMap(entries=6)
    shared = chunk_hashes("s" * 512, chunk_chars=128)  # 4 chunks
    prefixes.record(shared[:2], A)
    prefixes.record(shared, B)
    assert prefixes.matches(shared) == {B: 4}
    prefixes.record(shared[:2], A)  # A took a request of the first two chunks since
    assert prefixes.matches(shared) == {A: 2, B: 4}
    prefixes.record(chunk_hashes("t" * 384, chunk_chars=128), C)  # 3 more entries: the oldest go first
    assert len(prefixes) == 6 and prefixes.matches(shared) == {A: 2, B: 3}  # B's chain lost its end, the least used
    prefixes.forget([B, C])
    assert prefixes.matches(shared) == {}


def test_the_rank_holding_the_prefix_wins_within_the_load_bound():
    loads = {A: RankLoad(requests=3), B: RankLoad(requests=0)}
    assert choose([A, B], loads, {A: 5})[0] == A  # 3 more than the least loaded: within the slack of 4
    loads[A] = RankLoad(requests=5)
    assert choose([A, B], loads, {A: 5}) == [B, A]  # too busy: the least loaded
    busy = {A: RankLoad(requests=29), B: RankLoad(requests=20)}  # 50 % of 20 = 10 > 4: the ratio bounds it
    assert choose([A, B], busy, {A: 1})[0] == A
    assert choose([A, B], {A: RankLoad(kv_usage=0.97), B: RankLoad()}, {A: 5})[0] == B  # its cache is full
    assert choose([A, B, C], {}, {A: 2, C: 7})[0] == C  # the longest chain


def test_unready_ranks_come_last_and_are_tried_only_when_nothing_else_is():
    loads = {A: RankLoad(ready=False), B: RankLoad(requests=9), C: RankLoad(requests=2)}
    assert choose([A, B, C], loads, {A: 9}) == [C, B, A]  # the prefix rank is holding for its FFN: skipped
    assert choose([A], {A: RankLoad(ready=False)}, {}) == [A]
    assert choose([], {}, {}) == []


def test_requests_without_a_shared_prefix_take_the_least_loaded_ranks_in_turn():
    chooser = Chooser(ChoiceSettings())
    counts, took = {A: 0, B: 0}, {}
    for i in range(100):
        hashes = request_hashes("/v1/completions", {"model": "m", "prompt": f"{i} unique " * 40})
        took[i] = rank = chooser.order([A, B], {}, hashes)[0]
        chooser.prefixes.record(hashes, rank)
        counts[rank] += 1
    assert counts == {A: 50, B: 50}
    for i in (7, 8):  # the same prompt again: where it went before, whatever the turn
        again = request_hashes("/v1/completions", {"model": "m", "prompt": f"{i} unique " * 40})
        assert chooser.order([A, B], {}, again)[0] == took[i]


def test_the_load_gauges_are_read_from_a_ranks_exposition():
    text = "\n".join([
        "# HELP afd_requests_running Requests in the running batch",
        'afd_requests_running{rank="0",role="attention"} 3.0',
        'afd_requests_waiting{rank="0",role="attention"} 2.0',
        'afd_requests_resumed_total{rank="0",role="attention"} 7.0',
        'afd_kv_cache_usage_ratio{rank="0",role="attention"} 0.42',
    ])
    assert gauges(text) == (5.0, 0.42)
    assert gauges("garbage\nafd_requests_running oops") == (0.0, 0.0)


def test_the_watch_counts_this_replicas_requests_now_and_the_others_as_last_polled():
    import asyncio

    import httpx

    exposition = 'afd_requests_running{rank="0"} 3.0\nafd_requests_waiting{rank="0"} 1.0\nafd_kv_cache_usage_ratio 0.5\n'

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "gone":
            raise httpx.ConnectError("refused")
        if request.url.path == "/health":
            return httpx.Response(200 if request.url.host == "a" else 503)
        return httpx.Response(200, text=exposition)

    own = {A: 2}
    watch = RankWatch(lambda: {A: A, B: B, "http://gone": "http://gone"}, lambda: own)

    async def poll():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await watch.poll(client)

    asyncio.run(poll())
    assert watch.seen[A] == RankLoad(requests=2.0, kv_usage=0.5, ready=True)  # 4 on the rank, 2 of them ours
    assert watch.seen[B].ready is False and watch.seen["http://gone"] == RankLoad(ready=False)
    own[A] = 0  # ours finished since: only the others' remain
    assert watch.loads([A, C]) == {A: RankLoad(2.0, 0.5, True), C: RankLoad()}
    own[A] = 1
    assert watch.loads([A])[A].requests == 3.0


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}, None, 3, {"type": "image_url"}]}]},
    {"messages": [{"role": ["x"], "content": {"a": 1}}, "not a message", 7]},
    {"messages": [{"role": "user", "content": "\ud800" * 300}], "cache_salt": "\udfff"},
    {"prompt": ["\ud800" * 300]},
    {"prompt": [[1, 2], "x"]},
])
def test_a_hostile_body_is_keyed_never_an_error_so_the_rank_can_refuse_it_by_name(body):
    """The front door keys every body it forwards; a body the rank will refuse (a text part's text a number, lone
    surrogates) must reach the rank for its 400, not end in the front door's 500."""
    hashes = request_hashes("/v1/chat/completions" if "messages" in body else "/v1/completions", body)
    assert isinstance(hashes, list) and all(isinstance(h, bytes) for h in hashes)
