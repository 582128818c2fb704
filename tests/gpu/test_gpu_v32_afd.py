"""A reduced DeepSeek-V3.2-shaped model (V3's real MoE and MLA shapes, the indexer at its real dimensions: 64 heads of
128 from the 1536-wide query LoRA; two layers; index_topk 16 so the short prompts attend sparsely within 32 tokens)
in bf16 and FP8: the sparse decode's Triton kernels (index scores over the paged index cache, top-k, latent attention
over the chosen rows) in CUDA graphs give the eager steps' tokens, and the monolith's 32 greedy tokens equal AFD's over
NCCL (1A1F at stage 1 without graphs; in batch-invariant mode 2A1F at two stages with graphs and an FFN rank of two
expert-parallel shards with the gate on the attention side, as tests/gpu/test_gpu_v3_afd.py explains). Needs CUDA
and, for the NCCL cases, pairs (two GPUs, or AFD_GPU_SHARE_ONE=1 on one); about 35 GB of checkpoints under /tmp
(AFD_V3_FORMATS=fp8: 13 GB, the bf16 cases skip)."""

import pytest
import torch

from tests.gpu.nccl_env import nccl_pairs
from tests.gpu.test_gpu_v3_afd import FORMATS, afd_v3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def v32_checkpoints(tmp_path_factory):
    from tests.gpu.v3_checkpoint import V32_SHAPED, write_v3_shaped

    root = tmp_path_factory.mktemp("v32_shaped")
    bf16, fp8 = write_v3_shaped(*(root / name if name in FORMATS else None for name in ("bf16", "fp8")),
                                overrides=V32_SHAPED)
    return {"bf16": bf16, "fp8": fp8}


@pytest.fixture(scope="module")
def v32_monolith(v32_checkpoints):
    """The monolith's tokens per weight format (and batch-invariant mode or not), computed once (its model freed)."""
    from afd.kernels import batch_invariant
    from tests.gpu.test_gpu_path import monolithic

    tokens = {}

    def reference(weights: str, invariant: bool = False, graphs: bool = False) -> list:
        if v32_checkpoints[weights] is None:
            pytest.skip(f"AFD_V3_FORMATS={','.join(FORMATS)}: no {weights} checkpoint written")
        if (weights, invariant, graphs) not in tokens:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("AFD_BATCH_INVARIANT", "1" if invariant else "0")
                result, runner = monolithic(v32_checkpoints[weights], torch.bfloat16, graphs=graphs)
            batch_invariant.uninstall()
            indexer = runner.model.layers[0].self_attn.indexer
            assert indexer.weights_proj.weight.dtype == torch.float32  # as transformers keeps it
            if weights == "fp8":
                assert type(indexer.wq_b).__name__ == "Fp8Linear" and type(indexer.wk).__name__ == "Fp8Linear"
            if graphs:
                assert runner.graphs.replays > 0
            tokens[weights, invariant, graphs] = result.tokens
            del runner
            torch.cuda.empty_cache()
        return tokens[weights, invariant, graphs]

    return reference


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_v32_sparse_decode_graphs_equal_eager_steps(weights, v32_monolith):
    """Decode graphs replay the sparse kernels (the choice made on the device at every step, any context length)."""
    assert v32_monolith(weights, invariant=True, graphs=True) == v32_monolith(weights, invariant=True)


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_v32_sparse_kernels_choose_as_the_torch_path(weights, v32_checkpoints, monkeypatch):
    """One decode step at a 40-token context (16 of 40 keys chosen): the Triton path's attention output equals the
    plain-torch path's (`afd.models.dsa`) on the same cache."""
    from afd.kv.cache import KVCache
    from afd.models.loader import load_model
    from afd.models.paged_attention import AttentionBatch

    if v32_checkpoints[weights] is None:
        pytest.skip(f"AFD_V3_FORMATS={','.join(FORMATS)}: no {weights} checkpoint written")
    loaded = load_model(str(v32_checkpoints[weights]), dtype=torch.bfloat16, device="cuda")
    attention = loaded.model.layers[1].self_attn
    cache = KVCache(loaded.model.kv_layouts(), 8, torch.bfloat16, "cuda", block_size=16)
    torch.manual_seed(0)
    prompt = AttentionBatch.build([[3, 1, 5]], [0], [40], 16, "cuda")
    with torch.inference_mode():
        attention(torch.randn(40, 7168, device="cuda", dtype=torch.bfloat16) * 0.5, prompt, *cache.layer(1))
        step = AttentionBatch.build([[3, 1, 5]], [40], [1], 16, "cuda")
        x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16) * 0.5
        inputs, _ = attention._project(x, step.positions, None)
        kernels = attention.attend(inputs, step, *cache.layer(1))
        monkeypatch.setattr("afd.models.deepseek_v32.fused_glue", lambda t: False)  # the plain-torch path
        reference = attention.attend(inputs, step, *cache.layer(1))
    assert float((kernels.float() - reference.float()).norm() / reference.float().norm()) < 2e-2


@nccl_pairs
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_v32_shaped_monolith_equals_afd_over_nccl(weights, v32_checkpoints, v32_monolith):
    reference = v32_monolith(weights)
    assert afd_v3(v32_checkpoints[weights], "1A1F", 1, False) == reference


@nccl_pairs
@pytest.mark.parametrize("weights, topology, stages, gate, shards", [
    ("fp8", "2A1F", 2, "ffn", 1), ("bf16", "1A1F", 2, "attention", 2)],
    ids=["fp8-2A1F-stages2", "bf16-1A1F-stages2-gate_attention-ep2"])
def test_v32_shaped_monolith_equals_afd_with_graphs_in_batch_invariant_mode(weights, topology, stages, gate, shards,
                                                                           v32_checkpoints, v32_monolith):
    reference = v32_monolith(weights, invariant=True)
    assert afd_v3(v32_checkpoints[weights], topology, stages, True, gate, shards, invariant=True) == reference
