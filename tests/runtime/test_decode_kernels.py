"""The paged decode kernels (key heads shared by their query heads, keys cut in slices and merged) equal plain
attention. Runs on a GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1 before Triton is imported)."""

import pytest
import torch

from tests.kernel_device import KERNEL_DTYPES, NO_KERNEL_DEVICE, LaunchRecorder, kernel_device

DEVICE = kernel_device()
needs_triton = pytest.mark.skipif(DEVICE is None, reason=NO_KERNEL_DEVICE)


def _case(seed: int, heads: int, kv_heads: int, dk: int, dv: int, lens: list[int], block_size: int = 4):
    torch.manual_seed(seed)
    width = max(-(-n // block_size) for n in lens) + 1
    rows = (len(lens) * width + 1) * block_size
    cache_k, cache_v = torch.randn(rows, kv_heads, dk), torch.randn(rows, kv_heads, dv)
    tables = torch.tensor([[s * width + b for b in range(width)][::-1] for s in range(len(lens))], dtype=torch.int32)
    return torch.randn(len(lens), heads, dk), cache_k, cache_v, tables, torch.tensor(lens, dtype=torch.int32), block_size


def _reference(q, cache_k, cache_v, tables, lens, block_size, scale):
    """Per sequence and head: softmax(q·k) v over its cached rows, in float64."""
    group = q.shape[1] // cache_k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], cache_v.shape[2], dtype=torch.float64)
    for s, length in enumerate(lens.tolist()):
        pos = torch.arange(length)
        rows = tables[s, pos // block_size].long() * block_size + pos % block_size
        for h in range(q.shape[1]):
            keys, values = cache_k[rows, h // group].double(), cache_v[rows, h // group].double()
            out[s, h] = torch.softmax(q[s, h].double() @ keys.T * scale, dim=-1) @ values
    return out


@needs_triton
@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("heads, kv_heads, dk, dv", [(8, 2, 32, 32), (4, 4, 48, 32), (32, 4, 16, 16)])
def test_grouped_decode_kernel_equals_attention(heads, kv_heads, dk, dv, splits):
    from afd.kernels.decode_attention import paged_decode_attention

    q, cache_k, cache_v, tables, lens, block_size = _case(splits, heads, kv_heads, dk, dv, [9, 1, 70])
    want = _reference(q, cache_k, cache_v, tables, lens, block_size, 0.2)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    got = paged_decode_attention(to(q), to(cache_k), to(cache_v), to(tables), to(lens), block_size, 0.2, splits=splits)
    assert got.shape == want.shape
    assert float((got.double().cpu() - want).norm() / want.norm()) < 1e-4


@needs_triton
@pytest.mark.parametrize("splits", [1, 5])
@pytest.mark.parametrize("heads", [4, 40])  # one block of 16 heads, or three (the last part-filled)
def test_latent_decode_kernel_in_slices_equals_attention(splits, heads):
    from afd.kernels.decode_attention import paged_latent_decode_attention

    latent, rope = 32, 16
    q, cache, _, tables, lens, block_size = _case(7, heads, 1, latent + rope, 1, [5, 1, 66])
    want = _reference(q, cache, cache[:, :, :latent], tables, lens, block_size, 0.3)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    got = paged_latent_decode_attention(to(q), to(cache), latent, to(tables), to(lens), block_size, 0.3, splits=splits)
    assert float((got.double().cpu() - want).norm() / want.norm()) < 1e-4


@needs_triton
@pytest.mark.parametrize("splits", [1, 5])
def test_latent_decode_kernel_with_64_heads_a_program_equals_attention_in_16_bits(splits):
    """DeepSeek-V3's 128 heads (here 80: a full block of 64 and a part-filled one) run 64 heads a program in
    16-bit: the same attention, within the 16-bit rounding."""
    from afd.kernels.decode_attention import latent_launch, paged_latent_decode_attention

    dtype = KERNEL_DTYPES[DEVICE]
    assert latent_launch(80, dtype)[0] == 64
    latent, rope = 32, 16
    q, cache, _, tables, lens, block_size = _case(9, 80, 1, latent + rope, 1, [5, 1, 66])
    q, cache = q.to(dtype), cache.to(dtype)
    want = _reference(q, cache, cache[:, :, :latent], tables, lens, block_size, 0.3)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    got = paged_latent_decode_attention(to(q), to(cache), latent, to(tables), to(lens), block_size, 0.3, splits=splits)
    assert float((got.double().cpu() - want).norm() / want.norm()) < 1e-2


def test_the_latent_kernel_serves_64_heads_a_program_where_a_layer_has_that_many_in_16_bits():
    from afd.kernels.decode_attention import latent_launch

    assert latent_launch(16, torch.bfloat16)[0] == 16  # DeepSeek-V2-Lite
    heads, launch = latent_launch(128, torch.bfloat16)  # DeepSeek-V3
    assert heads == 64 and launch.programs_per_multiprocessor == 1
    assert latent_launch(128, torch.float32)[0] == 16  # float32's accumulator would not fit registers


@needs_triton
@pytest.mark.parametrize("splits", [1, 5])
def test_latent_decode_kernel_takes_the_rotary_queries_apart(splits):
    """MLA's absorbed latent comes from its batched GEMM as a transposed view and the rotary part stays in the
    projection's output (issue 33: no concatenation): the same output as one concatenated query."""
    from afd.kernels.decode_attention import paged_latent_decode_attention

    latent, rope = 32, 16
    q, cache, _, tables, lens, block_size = _case(8, 4, 1, latent + rope, 1, [5, 1, 66])
    to = lambda t: t.to(DEVICE)  # noqa: E731
    want = paged_latent_decode_attention(to(q), to(cache), latent, to(tables), to(lens), block_size, 0.3, splits=splits)
    q_latent = to(q[..., :latent].transpose(0, 1).contiguous()).transpose(0, 1)  # [B, H, latent], head-major
    q_rope = to(torch.cat((torch.zeros(3, 4, 8), q[..., latent:]), -1))[..., 8:]  # inside a wider row
    got = paged_latent_decode_attention(q_latent, to(cache), latent, to(tables), to(lens), block_size, 0.3,
                                        splits=splits, q_rope=q_rope)
    assert torch.equal(got.cpu(), want.cpu())


def test_no_compile_time_constant_follows_the_slice_count(monkeypatch):
    """Eager steps (decodes beside a prompt) meet every slice count from 1 to 16: a constexpr following it compiled
    a kernel in the middle of serving for each (issue 33). Only whether keys are sliced at all may differ."""
    from afd.kernels import decode_attention

    launched = {}
    for name in ("_decode_kernel", "_latent_decode_kernel", "_combine_kernel"):
        monkeypatch.setattr(decode_attention, name, LaunchRecorder(launched, name))
    q, cache_k, cache_v, tables, lens, block_size = _case(9, 4, 1, 48, 32, [5, 1, 66])
    for splits in range(1, decode_attention.MAX_SPLITS + 1):
        decode_attention.paged_decode_attention(q, cache_k, cache_v, tables, lens, block_size, 0.3, splits=splits)
        decode_attention.paged_latent_decode_attention(q, cache_k, 32, tables, lens, block_size, 0.3, splits=splits)
    for name, constants in launched.items():
        variants = {tuple(sorted(c.items())) for c in constants}
        assert len(variants) == (1 if name == "_combine_kernel" else 2), (name, variants)
    with pytest.raises(ValueError, match="slices"):
        decode_attention.paged_decode_attention(q, cache_k, cache_v, tables, lens, block_size, 0.3, splits=17)


def test_nothing_an_eager_step_varies_is_specialized():
    """Triton compiles apart integer arguments equal to 1 or divisible by 16 unless told not to: the slice count
    and the block tables' width change from one eager step to the next (issue 33: compiles mid-serving)."""
    import triton

    from afd.kernels import decode_attention

    for kernel in (decode_attention._decode_kernel, decode_attention._latent_decode_kernel):
        if not isinstance(kernel, triton.runtime.jit.JITFunction):
            pytest.skip("the interpreter does not specialize")
        assert {"splits", "table_width"} <= set(kernel.do_not_specialize)
    assert "splits" in decode_attention._combine_kernel.do_not_specialize


def test_slices_fill_the_device_from_shapes_alone():
    pytest.importorskip("triton")
    from afd.kernels.decode_attention import MAX_SPLITS, plan_splits

    assert plan_splits(1, 132) == MAX_SPLITS  # one sequence: its keys over many multiprocessors
    assert plan_splits(32, 132) == 8  # at most two programs a multiprocessor (bench/kernels/decode_tune.py's best)
    assert plan_splits(64, 132) == 4
    assert plan_splits(128, 132) == 2
    assert plan_splits(264, 132) == 1  # enough programs: no slices, no merge kernel
    assert plan_splits(1000, 132) == 1
    assert plan_splits(32, 132, per_multiprocessor=1) == 4  # a math-bound launch (64 heads a program)
    with pytest.raises(ValueError, match="must be positive"):
        plan_splits(0, 132)
