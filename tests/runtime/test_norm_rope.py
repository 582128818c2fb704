"""The norm and rotary kernels (afd.kernels.norm_rope) equal the torch path of afd.models.layers, alone and inside
the attention projections of both families. Runs on a GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1
before Triton is imported)."""

import importlib.util
import os

import pytest
import torch

from afd.models import deepseek_v2, layers, qwen3_moe
from afd.models.checkpoint import Checkpoint
from afd.models.loader import load_model

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
    DEVICE = "cpu"
else:
    DEVICE = None
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU or TRITON_INTERPRET=1 with Triton installed")


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
