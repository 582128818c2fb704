"""Our single-device models equal transformers on the same checkpoint (the outside oracle)."""

import pytest
import torch

from afd.generation import greedy_generate
from afd.kv_cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic import MonolithicRunner
from tests.conftest import NEW_TOKENS, PROMPTS, max_relative_error


def monolithic_generate(path):
    loaded = load_model(str(path))
    kv_cache = KVCache(loaded.model.kv_layouts(), 8 * len(PROMPTS), torch.float32, "cpu", block_size=4)
    return greedy_generate(MonolithicRunner(loaded, kv_cache), kv_cache, PROMPTS, NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("name", ["deepseek_v2", "qwen3_moe", "deepseek_v2_full"])
def test_monolithic_equals_transformers(name, checkpoints, hf_reference):
    tokens, logits = hf_reference(name)
    result = monolithic_generate(checkpoints[name])
    assert result.tokens == tokens
    assert max_relative_error(result.last_logits, logits) < 1e-4


def test_batched_prefill_and_decode_equal_one_prompt_at_a_time(checkpoints):
    path = checkpoints["qwen3_moe"]
    together = monolithic_generate(path)
    loaded = load_model(str(path))
    kv_cache = KVCache(loaded.model.kv_layouts(), 8, torch.float32, "cpu", block_size=4)
    for index, prompt in enumerate(PROMPTS):
        alone = greedy_generate(MonolithicRunner(loaded, kv_cache), kv_cache, [prompt], NEW_TOKENS, ignore_eos=True)
        assert alone.tokens[0] == together.tokens[index]


def test_eos_stops_generation_unless_ignored(checkpoints):
    path = checkpoints["deepseek_v2"]
    loaded = load_model(str(path))
    kv_cache = KVCache(loaded.model.kv_layouts(), 8, torch.float32, "cpu", block_size=4)
    runner = MonolithicRunner(loaded, kv_cache)
    free_run = greedy_generate(runner, kv_cache, [PROMPTS[0]], NEW_TOKENS, ignore_eos=True).tokens[0]
    eos = free_run[3]  # pretend the 4th generated token is EOS
    stopped = greedy_generate(runner, kv_cache, [PROMPTS[0]], NEW_TOKENS, eos_token_ids=[eos]).tokens[0]
    assert stopped == free_run[: free_run.index(eos) + 1]
    assert kv_cache.free_blocks == 8  # blocks come back after generation
