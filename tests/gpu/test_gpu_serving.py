"""The serving loop on a GPU: pipelined = step by step with decode graphs; the step ceiling; KV sizing."""

import pytest
import torch

from afd.engine.request import SamplingParams
from afd.engine.tokenizer import load_tokenizer
from afd.kv_cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic import MonolithicRunner
from afd.server.ceiling import step_seconds
from tests.server.test_engine_pipeline import PROMPTS, run_engine, tokens_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def gpu_runner(checkpoints):
    path = str(checkpoints["deepseek_v2"])
    loaded = load_model(path, "monolithic", dtype=torch.bfloat16, device="cuda")
    runner = MonolithicRunner(loaded, KVCache.for_tokens(loaded.model.kv_layouts(), 8192, torch.bfloat16, "cuda"))
    runner.capture_graphs(8)
    return (loaded, load_tokenizer(path)), runner


def test_pipelined_loop_on_gpu_equals_step_by_step(gpu_runner):
    """Eight requests, eight seats: both loops run the same batches, so bf16 graphs give the same bits."""
    parts, runner = gpu_runner
    requests = [(p, SamplingParams(max_tokens=4 + i % 9, temperature=0, ignore_eos=True, logprobs=1 if i % 2 else None))
                for i, p in enumerate(PROMPTS[:8])]
    replays = runner.graphs.replays
    pipelined = run_engine(parts, requests, True, runner=runner)
    assert runner.graphs.replays > replays  # decode steps were graph-replayed
    assert pipelined == run_engine(parts, requests, False, runner=runner)
    chunked = run_engine(parts, requests, True, budget=4, runner=runner)  # other prefill numerics: lengths only
    assert [len(t) for t in tokens_of(chunked)] == [params.max_tokens for _, params in requests]


def test_step_ceiling_and_kv_sizing_on_gpu(gpu_runner):
    (loaded, _), runner = gpu_runner
    free = runner.kv_cache.free_blocks
    assert 0 < step_seconds(runner, runner.kv_cache, 8, context=100, steps=5) < 1
    assert runner.kv_cache.free_blocks == free
    layouts = loaded.model.kv_layouts()
    tokens = KVCache.tokens_on_device(layouts, torch.bfloat16, torch.device("cuda"), 0.9, 1 << 30)
    _, total = torch.cuda.mem_get_info()
    assert 0 < tokens * KVCache.bytes_per_token(layouts, torch.bfloat16) < 0.9 * total
