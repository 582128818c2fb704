"""DeepSeek-V3.2's sparse decode kernels (index scores over the paged index cache, top-k, latent attention over the
chosen rows) equal the plain-torch path the CPU runs (afd.models.dsa). On a GPU, or in Triton's CPU interpreter
(TRITON_INTERPRET=1 before Triton is imported)."""

import pytest
import torch

from afd.models.dsa import chosen_keys, index_scores
from tests.kernel_device import NO_KERNEL_DEVICE, kernel_device

DEVICE = kernel_device()
needs_triton = pytest.mark.skipif(DEVICE is None, reason=NO_KERNEL_DEVICE)
LATENT, ROPE, INDEX_HEADS, INDEX_DIM, BLOCK = 32, 16, 4, 32, 4


def _case(seed: int, heads: int, lens: list[int]):
    """Queries, a shuffled paged cache (latent rows and index keys at the same rows) and its tables."""
    torch.manual_seed(seed)
    width = max(-(-n // BLOCK) for n in lens) + 1
    rows = (len(lens) * width + 1) * BLOCK
    order = torch.randperm(len(lens) * width)
    tables = order.view(len(lens), width).to(torch.int32)
    return dict(q=torch.randn(len(lens), heads, LATENT), q_rope=torch.randn(len(lens), heads, ROPE),
                cache=torch.randn(rows, 1, LATENT + ROPE), index_q=torch.randn(len(lens), INDEX_HEADS, INDEX_DIM),
                index_w=torch.randn(len(lens), INDEX_HEADS), cache_index=torch.randn(rows, INDEX_DIM),
                tables=tables, lens=torch.tensor(lens, dtype=torch.int32))


def _rows(case):
    positions = torch.arange(case["tables"].shape[1] * BLOCK)
    return case["tables"][:, positions // BLOCK].long() * BLOCK + positions % BLOCK  # [B, W * block]


def _reference(case, topk: int, scale: float, index_scale: float) -> torch.Tensor:
    """The CPU path's choice and attention, in float64: [B, H, latent]."""
    rows = _rows(case)
    allowed = torch.arange(rows.shape[1])[None, :] < case["lens"][:, None]
    scores = index_scores(case["index_q"].unsqueeze(1), case["index_w"].unsqueeze(1), case["cache_index"][rows],
                          index_scale)[:, 0]
    chosen = chosen_keys(scores, allowed, topk)
    out = torch.zeros(*case["q"].shape, dtype=torch.float64)
    for s in range(rows.shape[0]):
        keys = case["cache"][rows[s][chosen[s]], 0].double()  # [n, latent + rope]
        query = torch.cat((case["q"][s], case["q_rope"][s]), dim=-1).double()  # [H, latent + rope]
        out[s] = torch.softmax(query @ keys.T * scale, dim=-1) @ keys[:, :LATENT]
    return out


def _to(case):
    return {name: t.to(DEVICE) for name, t in case.items()}


@needs_triton
def test_index_scores_kernel_equals_the_reference_and_is_minus_infinity_past_each_end():
    from afd.kernels.sparse_mla import paged_index_scores

    case = _case(1, 4, [9, 1, 70])
    rows = _rows(case)
    want = index_scores(case["index_q"].unsqueeze(1), case["index_w"].unsqueeze(1), case["cache_index"][rows],
                        0.25)[:, 0]
    d = _to(case)
    got = paged_index_scores(d["index_q"], d["index_w"], d["cache_index"], 0.25, d["tables"], d["lens"], BLOCK).cpu()
    assert got.shape == want.shape
    live = torch.arange(rows.shape[1])[None, :] < case["lens"][:, None]
    torch.testing.assert_close(got[live], want[live], rtol=1e-4, atol=1e-4)
    assert torch.isneginf(got[~live]).all()


@needs_triton
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads, topk", [(4, 8), (40, 16), (4, 128)])  # sparse; three head blocks; dense (topk > keys)
def test_sparse_latent_decode_equals_the_cpu_path(heads, topk, splits):
    from afd.kernels.sparse_mla import sparse_latent_decode

    case = _case(splits + heads, heads, [5, 1, 66, 23])
    want = _reference(case, topk, 0.3, 0.25)
    d = _to(case)
    got = sparse_latent_decode(d["q"], d["q_rope"], d["cache"], LATENT, d["index_q"], d["index_w"], d["cache_index"],
                               0.25, topk, d["tables"], d["lens"], BLOCK, 0.3, splits=splits)
    assert float((got.double().cpu() - want).norm() / want.norm()) < 1e-4


@needs_triton
def test_a_sequence_shorter_than_topk_attends_to_all_it_holds():
    """Chosen positions past a sequence's end (it holds fewer keys than topk; ascending, they come last) are skipped,
    however the slices fall."""
    from afd.kernels.sparse_mla import sparse_latent_attention

    case = _case(3, 4, [3, 7])
    d = _to(case)
    positions = torch.tensor([[0, 1, 2, 40, 41, 42, 43, 44], [0, 1, 2, 3, 4, 5, 6, 30]], dtype=torch.int32)
    want = _reference(case, 64, 0.3, 0.25)
    for splits in (1, 4):
        got = sparse_latent_attention(d["q"], d["q_rope"], d["cache"], LATENT, positions.to(DEVICE), d["tables"],
                                      d["lens"], BLOCK, 0.3, splits=splits).cpu()
        assert float((got.double() - want).norm() / want.norm()) < 1e-4


@needs_triton
def test_the_v32_attention_decodes_through_the_kernels_as_through_torch(tmp_path, monkeypatch):
    """The tiny V3.2's attention layer, one decode step over a 40-token context in a graph-shaped batch
    (`AttentionBatch.for_decode`): the kernel path (`fused_glue` on) equals the plain-torch path."""
    from afd.checkpoint_tools.tiny import make_tiny_model
    from afd.kv.cache import KVCache
    from afd.models.loader import load_model
    from afd.models.paged_attention import AttentionBatch

    loaded = load_model(str(make_tiny_model("deepseek_v32", tmp_path / "v32")), device=DEVICE)
    attention = loaded.model.layers[1].self_attn
    cache = KVCache(loaded.model.kv_layouts(), 16, torch.float32, DEVICE, block_size=BLOCK)
    tables = [[15, 3, 8, 1, 9, 0, 12, 4, 7, 2, 11], [5, 6, 10, 13, 14]]
    torch.manual_seed(0)
    with torch.inference_mode():
        prompts = AttentionBatch.build(tables, [0, 0], [40, 17], BLOCK, DEVICE)
        attention(torch.randn(57, 160, device=DEVICE), prompts, *cache.layer(1))
        width = max(map(len, tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
        positions = torch.tensor([40, 17], device=DEVICE)
        write = torch.tensor([table[0, 10] * BLOCK + 0, table[1, 4] * BLOCK + 1], device=DEVICE).long()
        step = AttentionBatch.for_decode(positions, write, table, (positions + 1).to(torch.int32), BLOCK)
        inputs = attention.project(torch.randn(2, 160, device=DEVICE), positions)
        monkeypatch.setattr("afd.models.deepseek_v32.fused_glue", lambda t: True)
        kernels = attention.attend(inputs, step, *cache.layer(1))
        monkeypatch.setattr("afd.models.deepseek_v32.fused_glue", lambda t: False)
        reference = attention.attend(inputs, step, *cache.layer(1))
        attention.index_topk = 10**6
        dense = attention.attend(inputs, step, *cache.layer(1))
    assert float((kernels - reference).norm() / reference.norm()) < 1e-4
    assert float((dense - reference).norm() / reference.norm()) > 1e-2  # 16 of 41 keys is not all of them


@needs_triton
def test_chosen_positions_are_ascending_with_those_past_the_end_last():
    from afd.kernels.sparse_mla import chosen_positions

    scores = torch.tensor([[0.5, 3.0, -1.0, 2.0, float("-inf"), float("-inf")], [1.0, float("-inf")] + [0.0] * 4])
    assert chosen_positions(scores.to(DEVICE), 4).tolist()[0] == [0, 1, 2, 3]
    assert chosen_positions(scores[:1].to(DEVICE), 2).tolist() == [[1, 3]]
    assert chosen_positions(scores[:1, :3].to(DEVICE), 4).tolist() == [[0, 1, 2]]


@needs_triton
def test_prompt_index_scores_kernel_equals_the_reference_causally():
    from afd.kernels.sparse_mla import prompt_index_scores

    torch.manual_seed(5)
    q, w, keys = torch.randn(45, INDEX_HEADS, INDEX_DIM), torch.randn(45, INDEX_HEADS), torch.randn(110, INDEX_DIM)
    want = index_scores(q, w, keys, 0.25)  # [45, 110]
    got = prompt_index_scores(q.to(DEVICE), w.to(DEVICE), keys.to(DEVICE), 0.25).cpu()
    allowed = torch.arange(110)[None, :] <= torch.arange(65, 110)[:, None]
    torch.testing.assert_close(got[allowed], want[allowed], rtol=1e-4, atol=1e-4)
    assert torch.isneginf(got[~allowed]).all()


@needs_triton
@pytest.mark.parametrize("context", [0, 30])  # a whole prompt; a chunk after 30 cached tokens
def test_the_v32_attention_prefills_through_the_kernels_as_through_torch(context, tmp_path, monkeypatch):
    """The tiny V3.2's attention layer over a 40-token prompt (or chunk): the sparse latent prefill (absorbed, the
    kernels) equals the CPU path (expanded per head, as transformers), decodes beside it included."""
    from afd.checkpoint_tools.tiny import make_tiny_model
    from afd.kv.cache import KVCache
    from afd.models.loader import load_model
    from afd.models.paged_attention import AttentionBatch

    loaded = load_model(str(make_tiny_model("deepseek_v32", tmp_path / "v32")), device=DEVICE)
    attention = loaded.model.layers[1].self_attn
    cache = KVCache(loaded.model.kv_layouts(), 32, torch.float32, DEVICE, block_size=BLOCK)
    tables = [list(range(31, 12, -1)), [2, 5, 9, 0, 1, 3, 4, 6, 7, 8]]
    torch.manual_seed(context)
    with torch.inference_mode():
        earlier = AttentionBatch.build(tables, [0, 0], [max(context, 1), 33], BLOCK, DEVICE)
        attention(torch.randn(max(context, 1) + 33, 160, device=DEVICE), earlier, *cache.layer(1))
        step = AttentionBatch.build(tables, [context, 33], [40, 1], BLOCK, DEVICE)
        inputs = attention.project(torch.randn(41, 160, device=DEVICE), step.positions)
        monkeypatch.setattr("afd.models.deepseek_v32.fused_glue", lambda t: True)
        kernels = attention.attend(inputs, step, *cache.layer(1))
        monkeypatch.setattr("afd.models.deepseek_v32.fused_glue", lambda t: False)
        reference = attention.attend(inputs, step, *cache.layer(1))
    assert float((kernels - reference).norm() / reference.norm()) < 1e-4


@needs_triton
@pytest.mark.parametrize("splits", [1, 3])
def test_a_sequence_within_topk_is_read_as_the_dense_kernel_reads_it_whatever_the_table_width(splits):
    """Holding no more than topk keys, a sequence's sparse step is the dense latent kernel's result to the bit, at
    any table width (an eager step's, or a decode graph's wider one): graphs and eager steps round it alike."""
    from afd.kernels.decode_attention import paged_latent_decode_attention
    from afd.kernels.sparse_mla import sparse_latent_decode

    d = _to(_case(11, 4, [5, 1, 23, 16]))
    dense = paged_latent_decode_attention(d["q"], d["cache"], LATENT, d["tables"], d["lens"], BLOCK, 0.3,
                                          splits=splits, q_rope=d["q_rope"])
    for width in (d["tables"].shape[1], d["tables"].shape[1] + 9):
        tables = torch.nn.functional.pad(d["tables"], (0, width - d["tables"].shape[1]))
        sparse = sparse_latent_decode(d["q"], d["q_rope"], d["cache"], LATENT, d["index_q"], d["index_w"],
                                      d["cache_index"], 0.25, 32, tables, d["lens"], BLOCK, 0.3, splits=splits)
        assert torch.equal(sparse, dense)
