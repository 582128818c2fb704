"""A step mixing decodes, a prompt chunk and a fresh prompt attends exactly as each sequence alone would."""

import pytest
import torch

from afd.models.paged_attention import AttentionBatch, cached_attention


def _naive(q, keys, values, context: int, scale: float) -> torch.Tensor:
    """softmax(q·kᵀ) v for one sequence's new queries [n, H, D] over its keys [L, H, D], causal from `context`."""
    n, length = q.shape[0], keys.shape[0]
    keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)  # query head h reads key head h // group
    values = values.repeat_interleave(q.shape[1] // values.shape[1], dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, keys) * scale
    allowed = torch.arange(length)[None, :] <= (context + torch.arange(n))[:, None]
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hnl,lhd->nhd", weights, values)


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_mixed_step_equals_each_sequence_alone(heads, kv_heads):
    torch.manual_seed(0)
    dim, block = 8, 4
    context_lens, new_lens = [9, 0, 5, 3], [1, 6, 4, 1]  # decode, fresh prompt, prompt chunk, decode
    tables = [[0, 1, 2], [3, 4], [5, 6, 7], [8]]
    cache_k = torch.zeros(9 * block, kv_heads, dim)
    cache_v = torch.zeros(9 * block, kv_heads, dim)
    batch = AttentionBatch.build(tables, context_lens, new_lens, block)
    history_k, history_v = [], []
    for table, context in zip(tables, context_lens):  # keys the sequences cached in earlier steps
        rows = [table[p // block] * block + p % block for p in range(context)]
        k, v = torch.randn(context, kv_heads, dim), torch.randn(context, kv_heads, dim)
        cache_k[rows], cache_v[rows] = k, v
        history_k.append(k)
        history_v.append(v)
    total = sum(new_lens)
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    got = cached_attention(q, k, v, cache_k, cache_v, batch, 0.5)
    start = 0
    for s, (context, new) in enumerate(zip(context_lens, new_lens)):
        piece = slice(start, start + new)
        keys = torch.cat((history_k[s], k[piece]))
        values = torch.cat((history_v[s], v[piece]))
        torch.testing.assert_close(got[piece], _naive(q[piece], keys, values, context, 0.5), rtol=1e-5, atol=1e-5)
        start += new


def test_a_mixed_step_copies_nothing_from_the_host_inside_the_layer(monkeypatch):
    """Per-step metadata is built once; a host-to-device copy per layer (torch.tensor of a list) waits for the GPU
    at every layer of an eager step."""
    torch.manual_seed(0)
    block = 4
    batch = AttentionBatch.build([[0, 1], [2, 3], [4]], [5, 0, 2], [1, 5, 1], block)
    assert batch.single_seqs.tolist() == [0, 2] and batch.single_lens.tolist() == [6, 3] and batch.single_longest == 6
    cache = torch.randn(6 * block, 1, 8)
    q, k = torch.randn(7, 2, 8), torch.randn(7, 1, 8)
    reference_k = cache.clone()
    expected = cached_attention(q, k, None, reference_k, reference_k[:, :, :4], batch, 0.5)

    def refused(*args, **kwargs):
        raise AssertionError("torch.tensor inside the layer: a host copy per layer")

    monkeypatch.setattr(torch, "tensor", refused)
    cache_k = cache.clone()
    got = cached_attention(q, k, None, cache_k, cache_k[:, :, :4], batch, 0.5)
    assert torch.equal(got, expected)


def test_prompt_layout_lists_every_prompt_once_for_one_varlen_call():
    """Decode, prompt, decode, chunk: the prompts' queries are flat tokens 1-5 and 7-9 (not consecutive: an index
    tensor), their keys every cache row of each, and the boundaries cumulative."""
    block = 4
    tables = [[0, 1], [2, 3], [4], [5, 6]]
    batch = AttentionBatch.build(tables, [4, 0, 2, 3], [1, 5, 1, 3], block)
    layout = batch.prompts
    assert layout.tokens.tolist() == [1, 2, 3, 4, 5, 7, 8, 9]
    assert layout.key_rows.tolist() == [8, 9, 10, 11, 12] + [20, 21, 22, 23, 24, 25]
    assert layout.cu_queries.tolist() == [0, 5, 8] and layout.cu_keys.tolist() == [0, 5, 11]
    assert layout.spans_host == ((0, 5, 0, 5), (5, 8, 5, 11))
    assert (layout.max_queries, layout.max_keys) == (5, 6)
    consecutive = AttentionBatch.build(tables, [0, 0, 2, 3], [2, 5, 1, 1], block).prompts
    assert consecutive.tokens == slice(0, 7)
    assert AttentionBatch.build(tables[:2], [4, 0], [1, 1], block).prompts is None
