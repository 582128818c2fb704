"""The FP8 KV cache (`kv_cache_dtype=fp8`) on a GPU: decode graphs over it replay what eager steps compute, AFD over
NCCL with it equals the monolith with it, and its logits stay within two e4m3 roundings of the bf16 cache's
(tests/runtime/test_kv_fp8.py has the bounds; bench/step/kv_fp8.py reports greedy agreement and the step time)."""

import pytest
import torch

from afd.models.kv_dtype import FP8
from bench.step.kv_fp8 import agreement_prompts, first_differences, forced_logits, logit_drift
from tests.conftest import max_relative_error
from tests.gpu.nccl_env import nccl_pairs
from tests.gpu.test_gpu_path import GPU_TOKENS, afd_nccl, monolithic

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", ["deepseek_v2", "qwen3_moe"])
def test_decode_graphs_over_an_fp8_cache_equal_eager_steps(name, checkpoints):
    """The fused glue writes the FP8 rows and the paged kernels read them inside captured graphs (and piecewise
    prompt graphs): the tokens of eager steps over the same FP8 cache."""
    eager, _ = monolithic(checkpoints[name], torch.bfloat16, kv_dtype=FP8)
    graphed, runner = monolithic(checkpoints[name], torch.bfloat16, graphs=True, mixed_tokens=64, kv_dtype=FP8)
    assert runner.kv_cache.keys[0].dtype == FP8
    assert runner.graphs.replays == GPU_TOKENS - 1 and runner.mixed_graphs.replays == 1
    assert graphed.tokens == eager.tokens
    assert max_relative_error(graphed.last_logits, eager.last_logits) < 2e-2


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3", "qwen3_moe", "glm4_moe"])
def test_fp8_cache_logits_stay_within_two_e4m3_roundings_of_the_bf16_caches(name, checkpoints):
    from afd.engine.generation import greedy_generate
    from afd.kv.cache import KVCache
    from afd.models.loader import load_model
    from afd.runners.monolithic_runner import MonolithicRunner

    loaded = load_model(str(checkpoints[name]), dtype=torch.bfloat16, device="cuda")
    prompts = agreement_prompts(loaded.spec.vocab_size)
    runs = {}
    for dtype in (torch.bfloat16, FP8):
        cache = KVCache.for_tokens(loaded.model.kv_layouts(), 16 * 64, dtype, "cuda")
        runs[dtype] = greedy_generate(MonolithicRunner(loaded, cache), cache, prompts, 32, ignore_eos=True,
                                      device="cuda").tokens
    drift = logit_drift(forced_logits(loaded, torch.bfloat16, prompts, runs[torch.bfloat16], "cuda"),
                        forced_logits(loaded, FP8, prompts, runs[torch.bfloat16], "cuda"))
    print(name, "first differing token per prompt:", first_differences(runs[torch.bfloat16], runs[FP8]), drift)
    assert drift["median_drift"] <= 2**-3, drift


@nccl_pairs
@pytest.mark.parametrize("stages, graphs", [(1, False), (2, True)])
def test_afd_over_nccl_with_an_fp8_cache_equals_the_fp8_monolith(stages, graphs, checkpoints):
    """The attention rank holds the FP8 cache; the FFN rank is untouched: the monolith's tokens with the same cache."""
    reference, _ = monolithic(checkpoints["deepseek_v2"], torch.bfloat16, graphs=graphs, kv_dtype=FP8)
    assert afd_nccl(checkpoints["deepseek_v2"], "1A1F", stages, graphs, kv_cache_dtype="fp8") == reference.tokens
