"""`afd generate`'s path: an offline batch through the Engine equals the reference greedy loop."""

import pytest
import torch

from afd.engine.offline import generate_with_engine
from afd.engine.generation import greedy_generate
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic_runner import MonolithicRunner

PROMPTS = [[5 + i, 6 + 2 * i, 7, 8 + i % 5, 9][: 2 + i % 4] for i in range(7)] + [list(range(3, 40))]


@pytest.fixture(scope="module")
def runner(checkpoints):
    loaded = load_model(str(checkpoints["qwen3_moe"]))
    return MonolithicRunner(loaded, KVCache.for_tokens(loaded.model.kv_layouts(), 2048, torch.float32, "cpu"))


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_engine_batch_equals_the_reference_loop_tokens_and_last_logits(runner, max_tokens):
    ours = generate_with_engine(runner, runner.kv_cache, PROMPTS, max_tokens, ignore_eos=True)
    reference = greedy_generate(runner, runner.kv_cache, PROMPTS, max_tokens, ignore_eos=True)
    assert ours.tokens == reference.tokens and all(len(t) == max_tokens for t in ours.tokens)
    for mine, theirs in zip(ours.last_logits, reference.last_logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert runner.kv_cache.usage == 0


def test_eos_ends_a_sequence_like_the_reference(runner):
    free = greedy_generate(runner, runner.kv_cache, PROMPTS, 8, ignore_eos=True).tokens
    eos = [free[0][2]]  # the first prompt's third token: it stops there, others wherever it comes up
    ours = generate_with_engine(runner, runner.kv_cache, PROMPTS, 8, eos_token_ids=eos)
    reference = greedy_generate(runner, runner.kv_cache, PROMPTS, 8, eos_token_ids=eos)
    assert ours.tokens == reference.tokens and ours.tokens[0] == free[0][:3]
    for mine, theirs in zip(ours.last_logits, reference.last_logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_bad_input_is_refused_with_the_reason(runner):
    with pytest.raises(ValueError, match="max_tokens"):
        generate_with_engine(runner, runner.kv_cache, PROMPTS, 0)
    with pytest.raises(ValueError, match="at least one token"):
        generate_with_engine(runner, runner.kv_cache, [[1], []], 3)
    assert generate_with_engine(runner, runner.kv_cache, [], 3).tokens == []
