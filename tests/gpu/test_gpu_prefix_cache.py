"""Prefix caching on the GPU path (issue 51): the monolith with decode graphs and piecewise prompt graphs, fp32, on
MLA (DeepSeek-V2) and GQA (Qwen3-MoE): prompts that hit the cache (a mid-block prefix, a whole prompt, chunks across
block boundaries) give the tokens of the same prompts with caching off and of transformers."""

import pytest
import torch

from afd.engine.engine import Engine
from afd.engine.text.tokenizer import load_tokenizer
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic_runner import MonolithicRunner
from tests.server.test_prefix_cache_engine import GREEDY, NEW, OTHER, SYSTEM, TAILS, hf_greedy
from tests.server.test_shared_prompt_edges import Collected, token_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def one_by_one_on_gpu(loaded, tokenizer, prompts, caching, budget):
    """Each prompt after the previous one finished, on a CUDA monolith with graphs; (outputs, runner)."""
    runner = MonolithicRunner(loaded, KVCache.for_tokens(loaded.model.kv_layouts(), 1024, torch.float32, "cuda"))
    runner.capture_graphs(8, mixed_tokens=64)
    engine = Engine(runner, runner.kv_cache, tokenizer, (), max_num_seqs=8, max_model_len=256,
                    max_num_batched_tokens=budget, device="cuda", prefix_caching=caching).start()
    results = []
    try:
        for prompt in prompts:
            outputs = Collected(1)
            engine.submit(prompt, GREEDY, outputs.collector(0))
            results.append(outputs.wait([0])[0])
    finally:
        engine.stop()
    assert all(o.error is None for outs in results for o in outs)
    return results, runner


@pytest.mark.parametrize("name", ["deepseek_v2", "qwen3_moe"])
@pytest.mark.parametrize("budget", [8192, 12], ids=["one_chunk", "chunked"])
def test_hits_with_graphs_equal_caching_off_and_transformers(name, budget, checkpoints):
    path = str(checkpoints[name])
    loaded, tokenizer = load_model(path, "monolithic", dtype=torch.float32, device="cuda"), load_tokenizer(path)
    first = SYSTEM + TAILS[0]
    prompts = [first, SYSTEM + TAILS[1], first, first + TAILS[2], OTHER]
    on, graphed = one_by_one_on_gpu(loaded, tokenizer, prompts, True, budget)
    off, _ = one_by_one_on_gpu(loaded, tokenizer, prompts, False, budget)
    assert graphed.graphs.replays > 0 and graphed.mixed_graphs.replays > 0  # decode and prompt steps replayed
    assert [token_ids(o) for o in on] == [token_ids(o) for o in off] == hf_greedy(path, prompts, NEW)
    assert [outs[-1].cached_tokens for outs in on] == [0, 32, 32, 48, 0]
