"""Graph policy on CPU: buckets, step modes, the FFN graph cache and padded decode replays."""

from types import SimpleNamespace

import pytest
import torch

from afd.graphs.buckets import bucket_for, capture_order, decode_buckets, ffn_graph_key, ffn_step_mode
from afd.graphs.ffn_graphs import FFNGraphs


def test_buckets_cover_the_largest_batch_and_pad_up():
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert decode_buckets(50, stages=2) == (2, 4, 8, 16, 32, 48, 64)
    assert bucket_for(3, decode_buckets(64)) == 4
    assert bucket_for(65, decode_buckets(64)) is None  # beyond the largest: eager
    assert capture_order([1, 8, 4]) == [8, 4, 1]


def plan(tokens, warmup=False, capture=False, replay=False):
    return SimpleNamespace(stage_tokens=tokens, warmup=warmup, capture=capture, replay=replay)


def test_step_mode_replays_only_when_every_plan_says_so():
    assert ffn_step_mode([(False, False, True)], True) == ("replay", "")
    assert ffn_step_mode([(False, False, True)], False) == ("eager", "no_graph")
    assert ffn_step_mode([(False, False, True)], False, may_capture=True) == ("capture", "")
    assert ffn_step_mode([(False, False, True), (False, False, False)], True) == ("eager", "mixed_plans")
    assert ffn_step_mode([(False, True, False)], False) == ("capture", "")
    assert ffn_step_mode([(False, False, False)], True) == ("eager", "plan_eager")


def test_a_plan_that_says_eager_is_never_served_from_a_graph():
    """afd-plugin bug #261: a decode key and an eager key may collide; the plan decides."""
    graphs, calls = FFNGraphs(torch.device("cpu")), []
    body = lambda: calls.append("body")  # noqa: E731
    assert graphs.run({b"a": plan((4,), capture=True)}, body) == "capture"
    assert graphs.run({b"a": plan((4,), replay=True)}, body) == "replay"
    assert graphs.run({b"a": plan((4,))}, body) == "eager"  # same key, no replay flag
    assert graphs.replays == 1 and graphs.eager_steps == {"plan_eager": 1}


def test_graph_keys_name_every_peer_and_its_stage_counts():
    assert ffn_graph_key({b"b": (2, 2), b"a": (4, 0)}) == ffn_graph_key({b"a": (4, 0), b"b": (2, 2)})
    assert ffn_graph_key({b"a": (4, 0)}) != ffn_graph_key({b"a": (0, 4)})
    assert ffn_graph_key({b"a": (4,)}) != ffn_graph_key({b"a2": (4,)})  # a new connection: a new key


def test_a_new_set_of_peers_is_captured_and_a_lost_peers_graphs_are_dropped():
    """One rank of 2A1F leaves: the other's steps (a key never seen) get a graph at once."""
    graphs, calls = FFNGraphs(torch.device("cpu")), []
    body = lambda: calls.append("body")  # noqa: E731
    assert graphs.run({b"a": plan((4,), capture=True), b"b": plan((2,), capture=True)}, body) == "capture"
    assert graphs.run({b"b": plan((2,), replay=True)}, body) == "capture"  # b alone: new key, captured
    assert graphs.run({b"b": plan((2,), replay=True)}, body) == "replay"
    pool = graphs.pool
    graphs.forget(b"a")
    assert list(graphs.graphs) == [ffn_graph_key({b"b": (2,)})] and graphs.pool is pool  # b's graph keeps it live
    graphs.forget(b"b")  # the pool's last graph: torch cannot capture into that pool again (seen on H200)
    assert graphs.graphs == {} and graphs.pool is not pool
    assert graphs.run({b"c": plan((2,), capture=True)}, body) == "capture"
    full = FFNGraphs(torch.device("cpu"), max_graphs=0)
    assert full.run({b"b": plan((2,), replay=True)}, body) == "eager" and full.eager_steps == {"no_graph": 1}


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2", "deepseek_v3_fp8"])
def test_padded_decode_replay_equals_eager_steps(name, checkpoints):
    """The static-buffer path (eager stand-in for CUDA graphs on CPU) gives the eager tokens."""
    from afd.engine.generation import greedy_generate
    from afd.kv.cache import KVCache
    from afd.models.loader import load_model
    from afd.runners.monolithic_runner import MonolithicRunner
    from tests.conftest import NEW_TOKENS, PROMPTS

    loaded = load_model(str(checkpoints[name]))
    kv_cache = KVCache(loaded.model.kv_layouts(), 40, torch.float32, "cpu", block_size=4)
    runner = MonolithicRunner(loaded, kv_cache)
    eager = greedy_generate(runner, kv_cache, PROMPTS, NEW_TOKENS, ignore_eos=True)
    runner.capture_graphs(8)
    graphed = greedy_generate(runner, kv_cache, PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert graphed.tokens == eager.tokens
    assert runner.graphs.replays == NEW_TOKENS - 1  # every decode step after the prefill
