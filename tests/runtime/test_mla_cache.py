"""DeepSeek attention caches its latent, not expanded per-head keys and values (issue 16)."""

import pytest
import torch

from afd.kv.cache import KVCache
from afd.models.paged_attention import AttentionBatch, _paged_decode_reference
from afd.models.spec import KVLayout, kv_layout

LITE = {  # DeepSeek-V2-Lite's attention shapes (config.json of the published checkpoint)
    "model_type": "deepseek_v2", "hidden_size": 2048, "num_attention_heads": 16, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_hidden_layers": 27,
}


def test_lite_caches_576_values_per_token_and_layer_about_9x_less_than_expanded():
    layout = kv_layout(LITE)
    assert layout == KVLayout(1, 576, 512, values_in_keys=True)
    latent = KVCache.bytes_per_token([layout] * 27, torch.bfloat16)
    expanded = KVCache.bytes_per_token([KVLayout(16, 192, 128)] * 27, torch.bfloat16)
    assert latent == 576 * 2 * 27 == 31_104
    assert expanded / latent == pytest.approx(8.89, abs=0.01)


def test_latent_cache_stores_one_tensor_per_layer_and_values_are_its_view():
    cache = KVCache([KVLayout(1, 40, 32, values_in_keys=True)] * 2, 3, torch.float32, "cpu", block_size=4)
    keys, values = cache.layer(0)
    assert values.shape == (16, 1, 32) and values.data_ptr() == keys.data_ptr()
    keys[5, 0, :] = torch.arange(40.0)
    assert torch.equal(values[5, 0], torch.arange(32.0))
    assert cache.nbytes == 2 * 16 * 40 * 4  # no second tensor
    assert cache.capacity_tokens == 12


def test_the_latent_cache_is_sized_by_its_real_bytes():
    layouts = [KVLayout(1, 576, 512, values_in_keys=True)] * 27
    assert KVCache.bytes_per_token(layouts, torch.bfloat16) == 31_104  # 27 layers x 576 x 2 bytes, no value tensor
    cache = KVCache.for_tokens(layouts, 1000, torch.bfloat16, "meta", block_size=16)
    assert cache.capacity_tokens == 1008 and cache.nbytes == (63 + 1) * 16 * 31_104  # plus the scratch block


def _latent_decode_case(seed: int = 0, heads: int = 4, latent: int = 32, rope: int = 8):
    torch.manual_seed(seed)
    lens = [5, 1, 13]
    blocks_per_seq, block_size = 4, 4
    rows = (len(lens) * blocks_per_seq + 1) * block_size
    cache = torch.randn(rows, 1, latent + rope)
    tables = torch.tensor([[s * blocks_per_seq + b for b in range(blocks_per_seq)][::-1] for s in range(len(lens))],
                          dtype=torch.int32)  # blocks out of order on purpose
    q = torch.randn(len(lens), heads, latent + rope)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32), block_size, latent


def _expanded_reference(q, cache, tables, lens, block_size, latent, scale):
    """Per sequence and head, softmax(q·k) v with k the whole row and v its latent part."""
    out = torch.zeros(q.shape[0], q.shape[1], latent)
    for s, length in enumerate(lens.tolist()):
        pos = torch.arange(length)
        rows = tables[s, pos // block_size].long() * block_size + pos % block_size
        keys = cache[rows, 0]  # [L, latent + rope]
        weights = torch.softmax(q[s] @ keys.T * scale, dim=-1)  # [H, L]
        out[s] = weights @ keys[:, :latent]
    return out


def test_decode_over_latent_rows_equals_the_per_sequence_reference():
    q, cache, tables, lens, block_size, latent = _latent_decode_case()
    batch = AttentionBatch(None, None, None, None, None, (), (), None, 0, 1, tables, lens, block_size)
    got = _paged_decode_reference(q, cache, cache[:, :, :latent], batch, 0.3)
    want = _expanded_reference(q, cache, tables, lens, block_size, latent, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
