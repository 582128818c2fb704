"""The steps a GPU rank runs before serving (afd.runners.warm_steps): their layouts stay inside the step budget
and cover what serving meets; running them goes through the runner both ways and gives every block back."""

import pytest
import torch

from afd.config import AFDConfig
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic_runner import MonolithicRunner
from afd.runners.warm_steps import plan_warm_steps, run_warm_steps, warm_rank


def test_the_layouts_are_a_continued_chunk_a_prompt_beside_few_and_many_decodes_and_two_prompts():
    assert plan_warm_steps(8192, 256, 16, 4096, piecewise_tokens=512) == [
        ((17,), (35,)),
        ((0, 17), (35, 1)),
        ((0,) + (17,) * 255, (35,) + (1,) * 255),  # as many as a step seats (the piecewise graphs hold 477)
        ((0, 0), (35, 34)),
    ]
    assert plan_warm_steps(8192, 256, 16, 4096, piecewise_tokens=128)[2] == ((0,) + (17,) * 93, (35,) + (1,) * 93)


@pytest.mark.parametrize("max_tokens, max_seqs, block, max_len, piecewise", [
    (8192, 256, 16, 4096, 512), (40, 6, 16, 4096, 32), (5, 3, 16, 100, 0), (64, 1, 16, 64, 0), (9, 9, 1, 10, 8)])
def test_every_layout_fits_the_budget_and_seats_and_adds_a_prompt(max_tokens, max_seqs, block, max_len, piecewise):
    steps = plan_warm_steps(max_tokens, max_seqs, block, max_len, piecewise)
    assert steps
    for contexts, new_lens in steps:
        assert len(contexts) == len(new_lens) <= max_seqs
        assert sum(new_lens) <= max_tokens and max(new_lens) >= 2  # a prompt step, not a decode step
        assert all(c + n <= max_len for c, n in zip(contexts, new_lens))
        assert all(c > 0 for c, n in zip(contexts, new_lens) if n == 1)  # one-token rows are decoding sequences


def test_no_room_for_a_prompt_gives_no_steps_and_bad_limits_are_named():
    assert plan_warm_steps(3, 4, 16, 100) == [] and plan_warm_steps(100, 4, 16, 2) == []
    with pytest.raises(ValueError, match="max_seqs 0"):
        plan_warm_steps(100, 0, 16, 100)


def test_running_them_goes_through_the_runner_as_it_serves_and_eagerly_and_gives_every_block_back(checkpoints):
    path = str(checkpoints["deepseek_v2"])
    loaded = load_model(path, "monolithic")
    kv_cache = KVCache.for_tokens(loaded.model.kv_layouts(), 512, torch.float32, "cpu")
    runner = MonolithicRunner(loaded, kv_cache)
    seen = []
    real_call = MonolithicRunner.__call__

    def step(self, input_ids, layout):
        seen.append((self.logit_rows is not None, layout.context_lens, layout.new_lens))
        assert len(input_ids) == layout.num_tokens
        return real_call(self, input_ids, layout)

    free = kv_cache.free_blocks
    steps = plan_warm_steps(40, 6, kv_cache.block_size, 4096, 32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MonolithicRunner, "__call__", step)
        assert run_warm_steps(runner, kv_cache, loaded.spec.vocab_size, steps) == 2 * len(steps)
    assert seen == [(eager, c, n) for c, n in steps for eager in (False, True)]
    assert kv_cache.free_blocks == free and runner.logit_rows is None and runner.row_logits is None


def test_a_layout_the_cache_cannot_hold_is_left_out_and_the_rest_run(checkpoints):
    path = str(checkpoints["qwen3_moe"])
    config = AFDConfig(role="monolithic", model=path, device="cpu", max_num_batched_tokens=40, max_num_seqs=6)
    loaded = load_model(path, "monolithic")
    kv_cache = KVCache.for_tokens(loaded.model.kv_layouts(), 4 * 16, torch.float32, "cpu")  # 4 blocks
    runner = MonolithicRunner(loaded, kv_cache)
    # the continued chunk (3 blocks), the prompt beside one decode (2 + 2) and two prompts (2 + 2) fit; the prompt
    # beside 5 decodes (2 + 10) does not
    assert warm_rank(config, loaded.spec, runner, kv_cache) == 3 * 2
    assert kv_cache.free_blocks == 4
