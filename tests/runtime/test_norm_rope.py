"""The norm and rotary kernels (afd.kernels.norm_rope) equal the torch path of afd.models.layers, alone and inside
the attention projections of both families. Runs on a GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1
before Triton is imported)."""

import pytest
import torch

from tests.kernel_device import NO_KERNEL_DEVICE, kernel_device

from afd.models import deepseek_v2, layers, qwen3_moe
from afd.models.checkpoint import Checkpoint
from afd.models.loader import load_model
from afd.models.rope import Rotary, apply_rope_halves, apply_rope_pairs

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

    rotary = Rotary({"rope_theta": 10000.0, "rope_type": "default"}, 16, max_positions=300)
    torch.manual_seed(1)
    x = torch.randn(5, 3, 24, device=DEVICE)[..., 8:]  # [T, heads, 16] inside a wider row
    positions = torch.tensor([0, 7, 299, 64, 1], device=DEVICE)
    cos, sin = rotary(positions)
    apply = apply_rope_pairs if interleaved else apply_rope_halves
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
    from afd.kv.cache import KVCache
    from afd.models.paged_attention import AttentionBatch

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
    from afd.kv.cache import KVCache
    from afd.runners.attention_runner import AttentionRunner, StepOptions
    from afd.step.stages import StagePolicy
    from afd.step.layout import SeqLayout
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


def test_mla_glue_in_one_launch_equals_the_rotary_and_norm_kernels_and_the_cache_write():
    """MLA's query rotary, latent norm, key rotary and cache write in one launch (issue 33) equal the three
    kernels and the indexed store they replace."""
    from afd.kernels.norm_rope import mla_rows_, rms_norm, rope_

    heads, nope, latent, rope, tokens = 3, 8, 24, 16, 5
    rotary = Rotary({"rope_theta": 10000.0, "rope_type": "default"}, rope, max_positions=300)
    table = rotary.table(torch.device(DEVICE))
    torch.manual_seed(4)
    query = torch.randn(tokens, heads, nope + rope, device=DEVICE)
    row = torch.randn(tokens, 2, latent + rope, device=DEVICE)[:, 0]  # rows with a stride
    weight = torch.randn(latent, device=DEVICE)
    positions = torch.tensor([0, 7, 299, 64, 1], device=DEVICE)
    write = torch.tensor([9, 2, 4, 11, 0], device=DEVICE)
    want_q, want_row = query.clone(), row.clone()
    rope_(want_q[..., nope:], positions, *table, interleaved=True)
    rms_norm(want_row[:, :latent], weight, 1e-6, out=want_row[:, :latent])
    rope_(want_row.view(tokens, 1, -1)[..., latent:], positions, *table, interleaved=True)
    want_cache = torch.zeros(12, 1, latent + rope, device=DEVICE)
    want_cache[write] = want_row.unsqueeze(1)
    cache = torch.zeros(12, 1, latent + rope, device=DEVICE)
    mla_rows_(query, row, weight, 1e-6, positions, *table, cache, write)
    torch.testing.assert_close(query, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(row, want_row, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache, want_cache, rtol=1e-6, atol=1e-6)


def test_qwen3_glue_in_one_launch_equals_the_norm_and_rotary_kernels_and_the_cache_writes():
    """Qwen3's q/k norms, rotaries and key/value cache writes in one launch (issue 33) equal the kernels and
    indexed stores they replace."""
    from afd.kernels.norm_rope import qk_rows_, rms_norm, rope_

    heads, kv_heads, dim, tokens = 6, 2, 16, 5
    rotary = Rotary({"rope_theta": 10000.0, "rope_type": "default"}, dim, max_positions=300)
    table = rotary.table(torch.device(DEVICE))
    torch.manual_seed(5)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE)  # one GEMM's output: strided views
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], 1))
    q_weight, k_weight = torch.randn(dim, device=DEVICE), torch.randn(dim, device=DEVICE)
    positions = torch.tensor([0, 7, 299, 64, 1], device=DEVICE)
    write = torch.tensor([9, 2, 4, 11, 0], device=DEVICE)
    want_q = rope_(rms_norm(q, q_weight, 1e-6), positions, *table, interleaved=False)
    want_k = rope_(rms_norm(k, k_weight, 1e-5), positions, *table, interleaved=False)
    want_ck, want_cv = torch.zeros(12, kv_heads, dim, device=DEVICE), torch.zeros(12, kv_heads, dim, device=DEVICE)
    want_ck[write], want_cv[write] = want_k, v
    cache_k, cache_v = torch.zeros_like(want_ck), torch.zeros_like(want_cv)
    qk_rows_(q, k, v, q_weight, k_weight, 1e-6, 1e-5, positions, *table, cache_k, cache_v, write)
    for got, want in ((q, want_q), (k, want_k), (cache_k, want_ck), (cache_v, want_cv)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["deepseek_v2", "qwen3_moe"])
def test_a_decode_step_with_fused_glue_equals_the_torch_path(arch, checkpoints, monkeypatch):
    """A decode step through block tables (what the decode graphs capture): the glue writes the cache rows, MLA's
    latent kernel takes the absorbed and rotary queries apart and the value GEMM writes o_proj's input (issue 33);
    logits and every cache row as the torch path leaves them."""
    from afd.kv.cache import KVCache
    from afd.models.paged_attention import AttentionBatch

    model = load_model(str(checkpoints[arch]), "monolithic").model.to(DEVICE)
    for layer in model.layers:  # the tiny checkpoints may not say; the fused glue needs its table
        if layer.self_attn.rotary.max_positions == 0:
            layer.self_attn.rotary.max_positions = 64
    ids = torch.tensor([3, 5], device=DEVICE)
    torch.manual_seed(6)
    start = KVCache(model.kv_layouts(), 4, torch.float32, DEVICE)
    for tensor in start.keys + start.values:
        tensor.normal_()
    results = {}
    for fused in (False, True):
        for module in (deepseek_v2, qwen3_moe, layers):
            monkeypatch.setattr(module, "fused_glue", lambda t, fused=fused: fused)
        if fused:  # and the input projections in one GEMM: the glue reads strided column views
            for layer in model.layers:
                layer.self_attn.fuse_projections()
        cache = KVCache(model.kv_layouts(), 4, torch.float32, DEVICE)
        for mine, theirs in zip(cache.keys + cache.values, start.keys + start.values):
            mine.copy_(theirs)
        batch = AttentionBatch.for_decode(
            torch.tensor([5, 19], device=DEVICE), torch.tensor([5, 2 * cache.block_size + 3], device=DEVICE),
            torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE),
            torch.tensor([6, 20], dtype=torch.int32, device=DEVICE), cache.block_size)
        with torch.no_grad():
            results[fused] = model(ids, batch, cache), cache
    (want, want_cache), (got, got_cache) = results[False], results[True]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(got_cache.keys + got_cache.values, want_cache.keys + want_cache.values):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
