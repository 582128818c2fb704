"""The Triton kernels over an FP8 KV cache (`kv_cache_dtype=fp8`): the fused rotary/cache-write kernels store what
`afd.models.kv_dtype.quantize` stores (saturated at ±448), and the paged decode kernels read an FP8 cache as the
torch reference reads its dequantized copy. Runs on a GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1
before Triton is imported)."""

import pytest
import torch

from afd.models import deepseek_v2, layers, qwen3_moe
from afd.models.kv_dtype import FP8, FP8_MAX, quantize
from afd.models.loader import load_model
from afd.models.rope import Rotary
from tests.kernel_device import NO_KERNEL_DEVICE, kernel_device
from tests.runtime.test_decode_kernels import _case, _reference

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=NO_KERNEL_DEVICE)


if DEVICE is not None:  # Triton is optional: only where the kernels run
    import triton
    import triton.language as tl

    from afd.kernels.norm_rope import _as_cache

    @triton.jit
    def _cast_kernel(x_ptr, out_ptr, count, BLOCK: tl.constexpr, SATURATE: tl.constexpr):
        """`_as_cache` of each float32 input stored into the FP8 output."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = offs < count
        tl.store(out_ptr + offs, _as_cache(tl.load(x_ptr + offs, mask=live), out_ptr, SATURATE), mask=live)


def _fp8(t: torch.Tensor) -> torch.Tensor:
    return quantize(t, FP8)


@pytest.mark.parametrize("splits", [1, 3])
def test_grouped_decode_kernel_reads_an_fp8_cache_as_its_dequantized_copy(splits):
    from afd.kernels.decode_attention import paged_decode_attention

    q, cache_k, cache_v, tables, lens, block_size = _case(11, 8, 2, 32, 32, [9, 1, 70])
    cache_k, cache_v = _fp8(cache_k), _fp8(cache_v)
    want = _reference(q, cache_k.float(), cache_v.float(), tables, lens, block_size, 0.2)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    got = paged_decode_attention(to(q), to(cache_k), to(cache_v), to(tables), to(lens), block_size, 0.2, splits=splits)
    assert float((got.double().cpu() - want).norm() / want.norm()) < 1e-4


@pytest.mark.parametrize("splits", [1, 5])
@pytest.mark.parametrize("apart", [False, True])  # the rotary queries in one tensor with the latent's, or apart
def test_latent_decode_kernel_reads_an_fp8_cache_as_its_dequantized_copy(splits, apart):
    from afd.kernels.decode_attention import paged_latent_decode_attention

    latent, rope = 32, 16
    q, cache, _, tables, lens, block_size = _case(12, 20, 1, latent + rope, 1, [5, 1, 66])
    cache = _fp8(cache)
    wide = cache.float()
    want = _reference(q, wide, wide[:, :, :latent], tables, lens, block_size, 0.3)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    q_rope = to(q[..., latent:]) if apart else None
    got = paged_latent_decode_attention(to(q[..., :latent] if apart else q), to(cache), latent, to(tables), to(lens),
                                        block_size, 0.3, splits=splits, q_rope=q_rope)
    assert float((got.double().cpu() - want).norm() / want.norm()) < 1e-4


def test_mla_glue_writes_the_fp8_rows_quantize_writes_saturated():
    """The fused MLA glue into an FP8 cache: the normed latent and rotated key of each token, cast as the torch
    path's `quantize` casts them (the same e4m3 values), ±448 where a large norm weight pushes the latent past it."""
    from afd.kernels.norm_rope import mla_rows_

    heads, nope, latent, rope, tokens = 3, 8, 24, 16, 5
    table = Rotary({"rope_theta": 10000.0, "rope_type": "default"}, rope, max_positions=300).table(torch.device(DEVICE))
    torch.manual_seed(4)
    query = torch.randn(tokens, heads, nope + rope, device=DEVICE)
    row = torch.randn(tokens, latent + rope, device=DEVICE)
    weight = torch.randn(latent, device=DEVICE) * 300  # some latents past e4m3's 448
    positions = torch.tensor([0, 7, 299, 64, 1], device=DEVICE)
    write = torch.tensor([9, 2, 4, 11, 0], device=DEVICE)
    want_row = row.clone()
    mla_rows_(query.clone(), want_row, weight, 1e-6, positions, *table)  # the glue without the write
    cache = torch.zeros(12, 1, latent + rope, dtype=FP8, device=DEVICE)
    mla_rows_(query, row, weight, 1e-6, positions, *table, cache, write)
    want = torch.zeros(12, 1, latent + rope)
    want[write.cpu()] = quantize(want_row.cpu(), FP8).float().unsqueeze(1)
    assert want.abs().max() == FP8_MAX  # saturated, not NaN
    assert torch.equal(cache.cpu().float(), want)


def test_qwen3_glue_writes_the_fp8_keys_and_values_quantize_writes_saturated():
    from afd.kernels.norm_rope import qk_rows_

    heads, kv_heads, dim, tokens = 6, 2, 16, 5
    table = Rotary({"rope_theta": 10000.0, "rope_type": "default"}, dim, max_positions=300).table(torch.device(DEVICE))
    torch.manual_seed(5)
    q, k = torch.randn(tokens, heads, dim, device=DEVICE), torch.randn(tokens, kv_heads, dim, device=DEVICE)
    v = torch.randn(tokens, kv_heads, dim, device=DEVICE) * 400  # some values past 448
    q_weight, k_weight = torch.randn(dim, device=DEVICE), torch.randn(dim, device=DEVICE)
    positions = torch.tensor([0, 7, 299, 64, 1], device=DEVICE)
    write = torch.tensor([9, 2, 4, 11, 0], device=DEVICE)
    want_k = k.clone()
    qk_rows_(q.clone(), want_k, v, q_weight, k_weight, 1e-6, 1e-5, positions, *table)
    cache_k = torch.zeros(12, kv_heads, dim, dtype=FP8, device=DEVICE)
    cache_v = torch.zeros_like(cache_k)
    qk_rows_(q, k, v, q_weight, k_weight, 1e-6, 1e-5, positions, *table, cache_k, cache_v, write)
    for got, rows in ((cache_k, want_k), (cache_v, v)):
        want = torch.zeros(12, kv_heads, dim)
        want[write.cpu()] = quantize(rows.cpu(), FP8).float()
        assert torch.equal(got.cpu().float(), want)
    assert cache_v.float().abs().max() == FP8_MAX


@pytest.mark.parametrize("arch", ["deepseek_v2", "qwen3_moe"])
def test_a_decode_step_over_an_fp8_cache_with_fused_glue_equals_the_torch_path(arch, checkpoints, monkeypatch):
    """A decode step through block tables over an FP8 cache: the glue kernel writes the FP8 rows and MLA's latent
    kernel reads them; logits and every cache byte as the torch path (indexed FP8 writes, dequantized reads)."""
    from afd.kv.cache import KVCache
    from afd.models.paged_attention import AttentionBatch

    model = load_model(str(checkpoints[arch]), "monolithic").model.to(DEVICE)
    for layer in model.layers:  # the tiny checkpoints may not say; the fused glue needs its table
        if layer.self_attn.rotary.max_positions == 0:
            layer.self_attn.rotary.max_positions = 64
    ids = torch.tensor([3, 5], device=DEVICE)
    torch.manual_seed(6)
    first = KVCache(model.kv_layouts(), 4, FP8, "cpu")
    start = [quantize(torch.randn(t.shape), FP8) for t in first.keys + first.values]
    results = {}
    for fused in (False, True):
        for module in (deepseek_v2, qwen3_moe, layers):
            monkeypatch.setattr(module, "fused_glue", lambda t, fused=fused: fused)
        cache = KVCache(model.kv_layouts(), 4, FP8, DEVICE)
        for mine, theirs in zip(cache.keys + cache.values, start):  # MLA's values: views of its keys
            mine.view(torch.uint8).copy_(theirs.view(torch.uint8))
        batch = AttentionBatch.for_decode(
            torch.tensor([5, 19], device=DEVICE), torch.tensor([5, 2 * cache.block_size + 3], device=DEVICE),
            torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE),
            torch.tensor([6, 20], dtype=torch.int32, device=DEVICE), cache.block_size)
        with torch.no_grad():
            results[fused] = model(ids, batch, cache), cache
    (want, want_cache), (got, got_cache) = results[False], results[True]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(got_cache.keys + got_cache.values, want_cache.keys + want_cache.values):
        assert torch.equal(mine.float(), theirs.float())


def test_the_kernels_fp8_rounding_is_torchs_cast_on_every_value_and_tie():
    """`_as_cache` into FP8 (what both glue kernels store) equals torch's saturating cast: on every e4m3 value, every
    midpoint between neighbours (ties to even), just beside them, across normals and subnormals, and past ±448."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()  # every e4m3 value, sorted
    middles = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, middles, middles * (1 + 2**-20), middles * (1 - 2**-20), torch.tensor([500.0, -1e4, 449.0])])
    out = torch.empty(len(x), dtype=FP8, device=DEVICE)
    _cast_kernel[(triton.cdiv(len(x), 256),)](x.to(DEVICE), out, len(x), BLOCK=256, SATURATE=FP8_MAX)
    assert torch.equal(out.cpu().float(), quantize(x, FP8).float())
