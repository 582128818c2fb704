"""The norm and rotary kernels (afd.kernels.norm_rope) equal the torch path of afd.models.layers, alone and inside
the attention projections of both families. Runs on a GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1
before Triton is imported)."""

import pytest
import torch

from tests.kernel_device import NO_KERNEL_DEVICE, kernel_device

from afd.models import deepseek_v2, layers, qwen3_moe
from afd.models.checkpoint import Checkpoint
from afd.models.loader import load_model

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=NO_KERNEL_DEVICE)


@pytest.mark.parametrize("rows, size", [(1, 64), (37, 512), (6, 100)])
def test_rms_norm_kernel_equals_the_torch_norm(rows, size, monkeypatch):
    from afd.kernels.norm_rope import rms_norm

    torch.manual_seed(rows)
    norm = layers.RMSNorm(size, 1e-6).to(DEVICE)
    norm.weight.data.normal_()
    x = torch.randn(rows, 3, size, device=DEVICE)[:, 1]  # rows with a stride: a view, as MLA's latent is
    monkeypatch.setattr(layers, "fused_glue", lambda t: False)
    want = norm(x)
    got = rms_norm(x, norm.weight, norm.eps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    inplace = x.clone()
    rms_norm(inplace, norm.weight, norm.eps, out=inplace)
    torch.testing.assert_close(inplace, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot scale rows of"):
        rms_norm(x, norm.weight[:-1], norm.eps)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_kernel_equals_the_torch_rotation(interleaved):
    from afd.kernels.norm_rope import rope_

    rotary = layers.Rotary({"rope_theta": 10000.0, "rope_type": "default"}, 16, max_positions=300)
    torch.manual_seed(1)
    x = torch.randn(5, 3, 24, device=DEVICE)[..., 8:]  # [T, heads, 16] inside a wider row
    positions = torch.tensor([0, 7, 299, 64, 1], device=DEVICE)
    cos, sin = rotary(positions)
    apply = layers.apply_rope_pairs if interleaved else layers.apply_rope_halves
    want = apply(x, cos, sin)
    got = rope_(x.clone(), positions, *rotary.table(x.device), interleaved=interleaved)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v2_full", "qwen3_moe"])
def test_fused_projections_equal_the_torch_path(arch, checkpoints, monkeypatch):
    model = load_model(str(checkpoints[arch]), "monolithic").model.to(DEVICE)
    attn = model.layers[0].self_attn
    if attn.rotary.max_positions == 0:
        attn.rotary.max_positions = Checkpoint(str(checkpoints[arch])).config["max_position_embeddings"]
    torch.manual_seed(2)
    x = torch.randn(7, model.spec.hidden_size, device=DEVICE)
    positions = torch.tensor([0, 1, 2, 3, 40, 41, 5], device=DEVICE)
    family = deepseek_v2 if arch.startswith("deepseek") else qwen3_moe
    with torch.no_grad():
        for module in (family, layers):
            monkeypatch.setattr(module, "fused_glue", lambda t: False)
        want = attn.project(x, positions)
        for module in (family, layers):
            monkeypatch.setattr(module, "fused_glue", lambda t: True)
        got = attn.project(x, positions)
    assert attn.rotary.table(x.device) is not None
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_add_and_norm_in_one_launch_equals_the_add_then_the_norm_kernel():
    from afd.kernels.norm_rope import add_rms_norm, rms_norm

    torch.manual_seed(3)
    x, residual = torch.randn(9, 2048, device=DEVICE), torch.randn(9, 2048, device=DEVICE)
    weight = torch.randn(2048, device=DEVICE)
    total, normed = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, rms_norm(residual + x, weight, 1e-6))  # AFD adds, then norms: the same bits
    with pytest.raises(ValueError, match="cannot be added"):
        add_rms_norm(x, residual[:3], weight, 1e-6)


@pytest.mark.parametrize("arch", ["deepseek_v2", "qwen3_moe"])
def test_the_monolithic_forward_with_fused_glue_equals_the_torch_path(arch, checkpoints, monkeypatch):
    from afd.kv_cache import KVCache
    from afd.models.attention import AttentionBatch

    model = load_model(str(checkpoints[arch]), "monolithic").model.to(DEVICE)
    ids = torch.tensor([3, 5, 7, 11, 13, 17], device=DEVICE)
    logits = {}
    for fused in (False, True):
        for module in (deepseek_v2, qwen3_moe, layers):
            monkeypatch.setattr(module, "fused_glue", lambda t, fused=fused: fused)
        cache = KVCache(model.kv_layouts(), 4, torch.float32, DEVICE)
        batch = AttentionBatch.build([(0,), (1,)], [0, 0], [4, 2], cache.block_size, DEVICE)
        with torch.no_grad():
            logits[fused] = model(ids, batch, cache)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stages", [1, 2])
def test_the_attention_rank_with_fused_glue_equals_the_torch_path(stages, checkpoints, monkeypatch):
    """Each FFN output comes back added to the residual stream in one launch with the next layer's norm."""
    from afd.kv_cache import KVCache
    from afd.runners.attention_runner import AttentionRunner, StepOptions
    from afd.stages import StagePolicy
    from afd.layout import SeqLayout
    from afd.runners.profile_step import StandInFFN

    loaded = load_model(str(checkpoints["deepseek_v2"]), "attention")
    loaded.model.to(DEVICE)
    ids = torch.tensor([3, 5, 7, 11, 13, 17], device=DEVICE)
    logits = {}
    for fused in (False, True):
        for module in (deepseek_v2, layers):
            monkeypatch.setattr(module, "fused_glue", lambda t, fused=fused: fused)
        cache = KVCache(loaded.model.kv_layouts(), 4, torch.float32, DEVICE)
        runner = AttentionRunner(loaded, StandInFFN(), cache, StepOptions(StagePolicy(stages)))
        with torch.no_grad():
            logits[fused] = runner(ids, SeqLayout(((0,), (1,)), (0, 0), (4, 2)))
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
