"""Batch-invariant mode on a GPU (AFD_BATCH_INVARIANT=1): a monolith that runs PROMPTS all together, in the two
blocks a 2A1F deployment's attention ranks take, and one at a time gives every sequence the same greedy tokens and
the same last logits, bit for bit, with and without CUDA graphs (bf16, tiny DeepSeek-V3 and Qwen3-MoE). Skips
without CUDA."""

import pytest
import torch

from tests.conftest import PROMPTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def invariant(monkeypatch):
    monkeypatch.setenv("AFD_BATCH_INVARIANT", "1")
    yield
    from afd.kernels import batch_invariant

    batch_invariant.uninstall()  # the loader installed it for the process: later tests get cuBLAS again


def generate(path, prompts: list, graphs: bool):
    from tests.gpu.test_gpu_path import monolithic

    return monolithic(path, torch.bfloat16, graphs, prompts=prompts, max_tokens=16)[0]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe"])
def test_a_sequences_result_does_not_depend_on_its_company(name, graphs, checkpoints, invariant):
    from afd.kernels import batch_invariant
    from afd.local.offline_batch import split_prompts

    together = generate(checkpoints[name], PROMPTS, graphs)
    assert batch_invariant.installed()
    groupings = [split_prompts(len(PROMPTS), 2), [[index] for index in range(len(PROMPTS))]]
    for blocks in groupings:
        for block in blocks:
            apart = generate(checkpoints[name], [PROMPTS[index] for index in block], graphs)
            for position, index in enumerate(block):
                assert apart.tokens[position] == together.tokens[index], (blocks, index)
                assert torch.equal(apart.last_logits[position], together.last_logits[index]), (blocks, index)
