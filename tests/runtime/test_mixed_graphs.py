"""Piecewise graphs for prompt steps (afd.graphs.mixed) on CPU: the eager stand-in pool runs the same
static-buffer path a CUDA capture replays, so padding, bucket choice and segment order are checked here."""

import pytest
import torch

from afd.graphs.mixed import token_buckets
from afd.step.layout import SeqLayout


def test_token_buckets_double_to_256_then_step_by_256_then_512():
    assert token_buckets(2048) == (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048)
    assert token_buckets(100) == (16, 32, 64, 128)
    assert token_buckets(1) == (16,)
    assert token_buckets(1100) == (16, 32, 64, 128, 256, 512, 768, 1024, 1536)
    with pytest.raises(ValueError, match="max_tokens=0"):
        token_buckets(0)


def _steps(kv_cache):
    """Three steps over two sequences and a third: both prompts, then one decode beside a prompt chunk,
    then a chunk too large for the buckets (eager)."""
    tables = [tuple(kv_cache.allocate(48)) for _ in range(3)]
    return [
        (torch.tensor([5, 6, 7, 8, 9, 11, 12]), SeqLayout(tables[:2], (0, 0), (5, 2))),
        (torch.tensor([13, 3, 4, 5, 6, 7, 8, 9, 10, 11, 14]), SeqLayout(tables, (5, 2, 0), (1, 1, 9))),
        (torch.tensor(list(range(20, 40))), SeqLayout(tables[2:], (9,), (20,))),
    ]


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2", "deepseek_v2_full", "deepseek_v3", "glm4_moe"])
def test_piecewise_prompt_steps_give_the_eager_logits(name, checkpoints):
    from afd.kv.cache import KVCache
    from afd.models.loader import load_model
    from afd.runners.monolithic_runner import MonolithicRunner

    loaded = load_model(str(checkpoints[name]))
    results = {}
    for mixed in (0, 16):
        kv_cache = KVCache(loaded.model.kv_layouts(), 40, torch.float32, "cpu", block_size=4)
        runner = MonolithicRunner(loaded, kv_cache)
        runner.capture_graphs(4, mixed_tokens=mixed)
        results[mixed] = [runner(ids, layout) for ids, layout in _steps(kv_cache)]
        if mixed:
            assert runner.mixed_graphs.buckets == (16,)
            assert runner.mixed_graphs.replays == 2  # the 20-token chunk ran eagerly
            assert runner.graphs.replays == 0
    for eager, piecewise in zip(results[0], results[16]):
        assert eager.shape == piecewise.shape
        torch.testing.assert_close(piecewise, eager, rtol=1e-5, atol=1e-5)


def test_padding_rows_never_reach_the_cache(checkpoints):
    """Only the step's own tokens are written: every cache row outside its blocks is untouched."""
    from afd.kv.cache import KVCache
    from afd.models.loader import load_model
    from afd.runners.monolithic_runner import MonolithicRunner

    loaded = load_model(str(checkpoints["deepseek_v2"]))
    kv_cache = KVCache(loaded.model.kv_layouts(), 40, torch.float32, "cpu", block_size=4)
    runner = MonolithicRunner(loaded, kv_cache)
    runner.capture_graphs(4, mixed_tokens=16)
    table = tuple(kv_cache.allocate(8))
    before = [k.clone() for k in kv_cache.keys]
    runner(torch.tensor([5, 6, 7]), SeqLayout((table,), (0,), (3,)))
    written = {block * 4 + offset for block in table[:1] for offset in range(3)}
    for old, new in zip(before, kv_cache.keys):
        changed = {int(row) for row in torch.nonzero((old != new).flatten(1).any(1)).flatten()}
        assert changed == written


@pytest.mark.parametrize("name, topology, stages, gate", [
    ("deepseek_v2", "1A1F", 2, "attention"),
    ("deepseek_v2", "2A1F", 1, "ffn"),
    ("qwen3_moe", "1A1F", 1, "ffn"),
    ("qwen3_moe", "2A2F", 2, "attention"),
])
def test_attention_ranks_replay_prompt_steps_piecewise_with_the_ffn_rank_behind(name, topology, stages, gate, checkpoints,
                                                                                hf_reference, monkeypatch):
    """Graphs on (the eager stand-in pool on CPU): the prompt step replays its segments, each crossing layer's
    FFN input is shipped (padded to the bucket) and its output received in between, and the tokens are transformers'."""
    from afd.graphs import mixed
    from afd.local.group_threads import generate_in_threads
    from tests.conftest import NEW_TOKENS, PROMPTS, max_relative_error
    from tests.runtime.test_split_parity import loopback_config

    served = []
    run = mixed.MixedGraphs.run

    def counting(self, input_ids, layout):
        logits = run(self, input_ids, layout)
        served.append((layout.num_tokens, logits is not None))
        return logits

    monkeypatch.setattr(mixed.MixedGraphs, "run", counting)
    # graphs on the attention rank only: an FFN rank's graph cache replays NCCL transfers, which carry no step id
    for role in ("attention", "ffn"):
        monkeypatch.setattr(f"afd.roles.{role}.graphs_usable", lambda *settings, on=role == "attention": on)
    config = loopback_config(checkpoints[name], topology, stages, gate, tag="piecewise-").replace(
        cuda_graphs=True, mixed_graph_tokens=32)
    tokens, logits = hf_reference(name)
    result = generate_in_threads(config, PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert result.tokens == tokens
    assert max_relative_error(result.last_logits, logits) < 1e-4
    assert served and all(replayed for _, replayed in served)  # every prompt step (one per attention rank)
