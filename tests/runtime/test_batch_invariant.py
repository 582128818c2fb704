"""Batch-invariant mode (afd.kernels.batch_invariant): the one-tiling GEMM equals a float64 product; a row's result
is the same bits whatever other rows share its product; with the aten registrations in place torch's own calls
(F.linear, torch.bmm with out=, torch.mm with out_dtype, addmm) take it, and dropping them restores torch's; the
other kernels' switches (skinny table, decode slices, FP8 GEMM) follow the setting. Runs on a GPU, or in Triton's
CPU interpreter (TRITON_INTERPRET=1 before Triton is imported), where the registrations go on the CPU key."""

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_device import KERNEL_DTYPES, NO_KERNEL_DEVICE, kernel_device

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=NO_KERNEL_DEVICE)
DTYPE = KERNEL_DTYPES.get(DEVICE)  # the interpreter has no bfloat16 dots
DISPATCH_KEY = {"cuda": "CUDA", "cpu": "CPU"}.get(DEVICE)


def randn(*shape, seed: int = 0, dtype=None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype or DTYPE).to(DEVICE)


def close_to_float64(got: torch.Tensor, want: torch.Tensor) -> None:
    tolerance = {torch.float32: dict(rtol=1e-5, atol=1e-4)}.get(got.dtype, dict(rtol=2 ** -7, atol=2e-2))
    torch.testing.assert_close(got.double(), want.to(got.dtype).double(), **tolerance)


@pytest.fixture
def installed(monkeypatch):
    """The registrations in place on the kernel device's dispatch key for one test, then dropped."""
    from afd.kernels import batch_invariant

    monkeypatch.setenv("AFD_BATCH_INVARIANT", "1")
    assert batch_invariant.install(DISPATCH_KEY)
    try:
        yield batch_invariant
    finally:
        batch_invariant.uninstall()


def test_matmul_equals_a_float64_product_with_tails_strides_bias_and_batches():
    from afd.kernels.batch_invariant import matmul

    a, b = randn(70, 131, seed=1), randn(97, 131, seed=2)  # odd M, N and K: a tail in every tile dimension
    close_to_float64(matmul(a, b.t()), a.double() @ b.double().t())  # b through a transposed view
    bias = randn(97, seed=3)
    close_to_float64(matmul(a, b.t(), bias=bias), a.double() @ b.double().t() + bias.double())
    wide = matmul(a, b.t(), out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    close_to_float64(wide, a.double() @ b.double().t())
    batched_a, batched_b = randn(3, 20, 40, seed=4), randn(3, 33, 40, seed=5)
    out = torch.empty(20, 3, 33, dtype=DTYPE, device=DEVICE).transpose(0, 1)  # written through its strides
    assert matmul(batched_a, batched_b.transpose(1, 2), out=out) is out
    close_to_float64(out, batched_a.double() @ batched_b.double().transpose(1, 2))


@pytest.mark.parametrize("dtype", sorted({DTYPE, torch.float32}, key=str) if DEVICE else [None])
def test_a_rows_bits_do_not_depend_on_the_row_count(dtype):
    from afd.kernels.batch_invariant import matmul

    x, w = randn(150, 200, seed=6, dtype=dtype), randn(72, 200, seed=7, dtype=dtype)
    whole = matmul(x, w.t())
    for rows in (1, 2, 5, 16, 21, 64, 65, 130):
        assert torch.equal(matmul(x[:rows], w.t()), whole[:rows]), rows
        assert torch.equal(matmul(x[150 - rows:], w.t()), whole[150 - rows:]), rows  # other tile positions too


def test_bad_operands_are_named():
    from afd.kernels.batch_invariant import matmul

    with pytest.raises(RuntimeError, match=r"shapes \(4, 8\) and \(9, 3\)"):
        matmul(randn(4, 8), randn(9, 3))
    with pytest.raises(RuntimeError, match="of one dtype"):
        matmul(randn(4, 8), randn(8, 3, dtype=torch.float32))


def test_torch_calls_take_the_kernel_while_installed_and_not_after(installed):
    x, w, bias = randn(40, 96, seed=8), randn(56, 96, seed=9), randn(56, seed=10)
    linear = F.linear(x, w)  # aten mm
    for rows in (1, 3, 17):
        assert torch.equal(F.linear(x[:rows], w), linear[:rows]), rows
        assert torch.equal(F.linear(x[:rows], w, bias), installed.matmul(x[:rows], w.t(), bias=bias))  # addmm
    assert torch.equal(linear, installed.matmul(x, w.t()))
    wide = torch.mm(x, w.t(), out_dtype=torch.float32) if DEVICE == "cuda" else None  # mm.dtype: CUDA only
    if wide is not None:
        assert torch.equal(wide, installed.matmul(x, w.t(), out_dtype=torch.float32))
    heads, value_up = randn(4, 10, 32, seed=11), randn(4, 24, 32, seed=12)
    out = torch.empty(10, 4, 24, dtype=DTYPE, device=DEVICE)
    torch.bmm(heads, value_up.transpose(1, 2), out=out.transpose(0, 1))  # bmm.out into a transposed view, as MLA
    assert torch.equal(out.transpose(0, 1), installed.matmul(heads, value_up.transpose(1, 2)))
    other = torch.float64 if DTYPE != torch.float64 else torch.float32
    for call in (torch.mm, torch.bmm):  # an out of another dtype is refused, as aten refuses it
        operands = (x, w.t()) if call is torch.mm else (heads, value_up.transpose(1, 2))
        wrong = torch.empty(call(*operands).shape, dtype=other, device=DEVICE)
        with pytest.raises(RuntimeError, match="expected out tensor to have dtype"):
            call(*operands, out=wrong)
    nan = torch.full((10, 56), float("nan"), dtype=DTYPE, device=DEVICE)
    assert torch.equal(torch.addmm(nan, x[:10], w.t(), beta=0, alpha=2), linear[:10] * 2)  # beta 0: self ignored
    doubles = torch.randn(5, 7, dtype=torch.float64, device=DEVICE)  # a dtype the kernel does not take
    torch.testing.assert_close(torch.mm(doubles, doubles.t()), (doubles[:, None] * doubles[None]).sum(-1))
    installed.uninstall()
    assert not installed.installed()
    close_to_float64(F.linear(x, w), x.double() @ w.double().t())  # torch's own again


def test_install_is_idempotent(installed):
    assert installed.installed() and not installed.install(DISPATCH_KEY)


def test_the_other_kernels_follow_the_setting(monkeypatch):
    from afd.kernels import batch_invariant, decode_attention, skinny_gemm

    x, w = randn(4, 64, seed=13), randn(32, 64, seed=14)
    table = {(32, 64, 4, "input"): {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "DOT": False, "num_warps": 4,
                                    "num_stages": 2}}
    monkeypatch.setattr(skinny_gemm, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(skinny_gemm, "_choice", lambda name, n, k, m, out: skinny_gemm.pick(table, n, k, m, out))
    monkeypatch.setattr(skinny_gemm, "_device_name", lambda device: "test")
    monkeypatch.setenv("AFD_BATCH_INVARIANT", "0")
    assert skinny_gemm.choice(x, w) == table[(32, 64, 4, "input")]
    assert decode_attention.default_splits(1, torch.device(DEVICE)) > 1  # one program: slices fill the device
    monkeypatch.setenv("AFD_BATCH_INVARIANT", "1")
    assert batch_invariant.enabled()
    assert skinny_gemm.choice(x, w) is None  # torch's GEMM, which the registrations route to the fixed tiling
    assert decode_attention.default_splits(1, torch.device(DEVICE)) == batch_invariant.DECODE_SPLITS == 1


def test_fp8_projection_rows_do_not_depend_on_the_row_count(monkeypatch):
    """The FP8 GEMM at one setting (not cuBLASLt's, not per-row-count tiles) in the mode."""
    from afd.kernels import fp8_gemm
    from afd.kernels.fp8_blocks import quantize_block_fp8

    weight, scale = quantize_block_fp8(torch.randn(256, 384, generator=torch.Generator().manual_seed(15)))
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = randn(300, 384, seed=16)
    monkeypatch.setenv("AFD_BATCH_INVARIANT", "1")
    whole = fp8_gemm.fp8_linear(x, weight, scale)
    for rows in (1, 5, 16, 17, 64, 65, 257):  # every tile setting of gemm_settings' row classes
        assert torch.equal(fp8_gemm.fp8_linear(x[:rows], weight, scale), whole[:rows]), rows
