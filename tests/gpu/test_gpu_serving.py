"""The serving loop on a GPU: pipelined = step by step with decode graphs, monolithic and AFD over NCCL; the
step ceiling; KV sizing from the profiled largest step."""

import pytest
import torch

from afd.config import AFDConfig, config_to_env
from afd.engine.request import SamplingParams
from afd.engine.text.tokenizer import load_tokenizer
from afd.kv.budget import CudaMemory, profile_peak
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic_runner import MonolithicRunner
from afd.runners.profile_step import run_largest_steps
from afd.roles.kv_sizing import profiled_cache_tokens
from afd.server.serve.ceiling import step_seconds
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


def test_step_ceiling_and_kv_sizing_on_gpu(gpu_runner, checkpoints):
    """The KV cache is sized from the profiled peak of the largest step, which grows with the step budget."""
    (loaded, _), runner = gpu_runner
    free = runner.kv_cache.free_blocks
    seconds = step_seconds(runner, runner.kv_cache, 8, context=100, steps=5, vocab_size=loaded.spec.vocab_size)
    assert 0 < seconds < 1
    assert runner.kv_cache.free_blocks == free
    cuda, memory = torch.device("cuda"), CudaMemory(torch.device("cuda"))
    config = AFDConfig(role="monolithic", model=str(checkpoints["deepseek_v2"]), device="cuda", max_num_seqs=64)
    peaks = [profile_peak(lambda: run_largest_steps(config.replace(max_num_batched_tokens=budget), loaded,
                                                    torch.bfloat16, cuda, 8192), memory) for budget in (256, 4096)]
    assert 0 < peaks[0] < peaks[1]
    tokens = profiled_cache_tokens(config, loaded, memory, torch.bfloat16, cuda)
    _, total = torch.cuda.mem_get_info()
    assert 0 < tokens * KVCache.bytes_per_token(loaded.model.kv_layouts(), torch.bfloat16) < 0.9 * total - peaks[1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL pair needs two CUDA GPUs")
@pytest.mark.parametrize("graphs", [False, True])
def test_pipelined_afd_over_nccl_equals_step_by_step(checkpoints, graphs):
    """The attention rank here (GPU 0), its FFN rank a process on GPU 1: waiting for each step on the link
    after the next one is launched gives the same tokens as finishing every step first."""
    from afd.local.children import LocalProcesses
    from afd.local.group_processes import local_zmq_config
    from afd.roles.attention import build_attention

    path = str(checkpoints["deepseek_v2"])
    config = local_zmq_config(AFDConfig(
        model=path, dtype="bfloat16", device="cuda", stages=2, cuda_graphs=graphs, max_num_seqs=8, peer_timeout_s=60.0,
        connect_timeout_s=180.0)).replace(connector="nccl")
    requests = [(p, SamplingParams(max_tokens=4 + i % 9, temperature=0, ignore_eos=True, logprobs=1 if i % 2 else None))
                for i, p in enumerate(PROMPTS[:8])]
    with LocalProcesses() as processes:
        processes.start("ffn-0", ["serve"], {**config_to_env(config.replace(role="ffn")), "CUDA_VISIBLE_DEVICES": "1"})
        role = build_attention(config.replace(role="attention"), 4096)
        try:
            parts = (role.loaded, load_tokenizer(path))
            pipelined = run_engine(parts, requests, True, runner=role.runner, link=role.link)
            assert pipelined == run_engine(parts, requests, False, runner=role.runner, link=role.link)
            assert [len(t) for t in tokens_of(pipelined)] == [params.max_tokens for _, params in requests]
        finally:
            role.close("test done")
