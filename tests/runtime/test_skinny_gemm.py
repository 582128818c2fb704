"""The skinny GEMM (afd.kernels.skinny_gemm): the kernel equals a float32 product for 1..16 rows, with and without
split-K, bit-stable run to run; its table is read strictly; without a table entry every call is torch's GEMM.
Runs on a GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1 before Triton is imported)."""

import json

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_device import KERNEL_DTYPES, NO_KERNEL_DEVICE, kernel_device

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=NO_KERNEL_DEVICE)
DTYPE = KERNEL_DTYPES.get(DEVICE)  # the interpreter has no bfloat16 dots


def setting(**changes) -> dict:
    base = {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1, "DOT": False, "num_warps": 4, "num_stages": 2}
    return {**base, **changes}


def operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=generator).to(dtype).to(DEVICE)
    return x, w


def check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, out_dtype) -> None:
    want = x.double() @ w.double().t()  # every product of 16-bit values is exact; only the order of sums differs
    assert got.dtype == (out_dtype or x.dtype) and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:  # one rounding of the float32 sum to 16 bits
        torch.testing.assert_close(got.double(), want.to(got.dtype).double(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("m", range(1, 17))
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_kernel_equals_a_float32_product(m, out_dtype):
    from afd.kernels.skinny_gemm import gemm

    x, w = operands(m, 77, 301, DTYPE, seed=m)  # odd N and K: tails in both
    for dot in (False, True):
        for split in (1, 3):
            check(gemm(x, w, out_dtype, setting(DOT=dot, SPLIT_K=split)), x, w, out_dtype)


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_bfloat16_without_dots(out_dtype):
    from afd.kernels.skinny_gemm import gemm

    x, w = operands(5, 40, 130, torch.bfloat16)
    for split in (1, 2):
        check(gemm(x, w, out_dtype, setting(SPLIT_K=split, BLOCK_N=16, BLOCK_K=32)), x, w, out_dtype)


def test_strided_rows_and_more_splits_than_blocks():
    from afd.kernels.skinny_gemm import gemm

    x, w = operands(4, 50, 100, DTYPE)
    wide = torch.zeros(4, 300, dtype=DTYPE, device=DEVICE)
    wide[:, ::3] = x  # rows with a stride and a column stride of 3
    view = wide[:, ::3]
    assert not view.is_contiguous()
    check(gemm(view, w, torch.float32, setting(SPLIT_K=8, BLOCK_K=32)), x, w, torch.float32)  # 8 slices of 32 > 100


@pytest.mark.parametrize("dot", [False, True])
def test_the_same_inputs_give_the_same_bits(dot):
    from afd.kernels.skinny_gemm import gemm

    x, w = operands(7, 90, 515, DTYPE)
    for out_dtype in (None, torch.float32):
        chosen = setting(DOT=dot, SPLIT_K=4, BLOCK_K=32)
        first, second = gemm(x, w, out_dtype, chosen), gemm(x, w, out_dtype, chosen)
        assert torch.equal(first, second)
        assert first.abs().sum() > 0


@pytest.mark.parametrize("split", [1, 3, 8])
def test_unsummed_partials_add_up_in_split_order_to_the_summed_product(split):
    """`sum_splits=False`: the split-K partials a consumer adds itself (the routing kernel, issue 33); added in
    split order they are the float32 product's bits."""
    from afd.kernels.skinny_gemm import gemm, sum_partials

    x, w = operands(3, 96, 512, DTYPE, seed=split)  # K 512: whole slices of 32 for 1, 3 and 8 splits
    chosen = setting(SPLIT_K=split, BLOCK_K=32)
    partials = gemm(x, w, torch.float32, chosen, sum_splits=False)
    assert partials.dtype == torch.float32 and partials.shape == (split, 3, 96)
    assert torch.equal(sum_partials(partials), gemm(x, w, torch.float32, chosen))
    with pytest.raises(ValueError, match="partials are float32"):
        gemm(x, w, None, chosen, sum_splits=False)


def test_bad_calls_are_refused():
    from afd.kernels.skinny_gemm import gemm

    x, w = operands(2, 32, 64, DTYPE)
    with pytest.raises(ValueError, match="power of two"):
        gemm(x, w, None, setting(BLOCK_N=48))
    with pytest.raises(ValueError, match="exactly the keys"):
        gemm(x, w, None, {"BLOCK_N": 32})
    with pytest.raises(ValueError, match="1..16 rows"):
        gemm(torch.cat([x] * 9), w, None, setting())
    with pytest.raises(ValueError, match="need \\[M, K\\] and \\[N, K\\]"):
        gemm(x, w[:, :10], None, setting())
    with pytest.raises(ValueError, match="one dtype"):
        gemm(x, w.float(), None, setting())
    with pytest.raises(ValueError, match="only the input's dtype or float32"):
        gemm(x, w, torch.int32, setting())


# ---------------------------------------------------------------- the table
def write_table(path, entries) -> None:
    path.write_text(json.dumps({"device": "Test GPU", "entries": entries}))


@pytest.mark.parametrize("entries, complaint", [
    ("not json", "Expecting value"),
    ({"entries": "none"}, '"entries" list'),
    ([{"n": 8, "k": 8, "m": 17, "out": "input", "setting": "cublas"}], "m <= 16"),
    ([{"n": 8, "k": 8, "m": 1, "out": "half", "setting": "cublas"}], "out must be one of"),
    ([{"n": 8, "k": 8, "m": 1, "out": "input", "setting": {"BLOCK_N": 32}}], "exactly the keys"),
    ([{"n": 8, "k": 8, "m": 1, "out": "input", "setting": "cublas"}] * 2, "repeats its shape"),
])
def test_a_malformed_table_is_refused_naming_its_file(tmp_path, entries, complaint):
    from afd.kernels.skinny_gemm import read_table

    path = tmp_path / "skinny_Test_GPU.json"
    if isinstance(entries, str):
        path.write_text(entries)
    elif isinstance(entries, dict):
        path.write_text(json.dumps(entries))
    else:
        write_table(path, entries)
    with pytest.raises(ValueError, match=complaint) as err:
        read_table(path)
    assert str(path) in str(err.value)


def test_pick_takes_the_entry_of_m_or_the_nearest_larger():
    from afd.kernels.skinny_gemm import pick

    fast = setting(SPLIT_K=2)
    table = {(64, 128, 1, "input"): fast, (64, 128, 4, "input"): None, (64, 128, 8, "input"): setting()}
    assert pick(table, 64, 128, 1, "input") == fast
    assert pick(table, 64, 128, 2, "input") is None  # M 4 measured cuBLAS faster
    assert pick(table, 64, 128, 6, "input") == setting()
    assert pick(table, 64, 128, 9, "input") is None  # no measured M that large
    assert pick(table, 64, 128, 1, "float32") is None  # another output: not measured
    assert pick({}, 64, 128, 1, "input") is None


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """The hook consults tables on this device too (named "Test GPU"), read from an empty folder."""
    from afd.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(skinny_gemm, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(skinny_gemm, "_device_name", lambda device: "Test GPU")
    skinny_gemm.device_table.cache_clear()
    skinny_gemm._choice.cache_clear()
    yield tmp_path
    skinny_gemm.device_table.cache_clear()
    skinny_gemm._choice.cache_clear()


def launches(monkeypatch) -> list:
    """Count the skinny kernel's launches (each still runs)."""
    from afd.kernels import skinny_gemm

    seen, kernel = [], skinny_gemm._skinny_kernel

    class Counting:
        def __getitem__(self, grid):
            seen.append(grid)
            return kernel[grid]

    monkeypatch.setattr(skinny_gemm, "_skinny_kernel", Counting())
    return seen


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_the_hook_is_torch_unless_the_table_picks_the_kernel(table_dir, monkeypatch, out_dtype):
    from afd.kernels import skinny_gemm
    from afd.models import layers

    seen = launches(monkeypatch)
    x, w = operands(3, 64, 96, DTYPE)
    assert torch.equal(skinny_gemm.linear(x, w, out_dtype), skinny_gemm.torch_linear(x, w, out_dtype))
    assert seen == []  # no table: torch's GEMM
    out = "input" if out_dtype is None else "float32"
    write_table(table_dir / "skinny_Test_GPU.json", [
        {"n": 64, "k": 96, "m": 4, "out": out, "setting": setting(SPLIT_K=2)},
        {"n": 64, "k": 96, "m": 1, "out": out, "setting": "cublas"}])
    skinny_gemm.device_table.cache_clear()
    skinny_gemm._choice.cache_clear()
    check(skinny_gemm.linear(x, w, out_dtype), x, w, out_dtype)  # M 3 takes M 4's entry
    assert len(seen) == 1
    check(layers.cuda_linear(x, w, out_dtype), x, w, out_dtype)  # the models' hook goes the same way
    assert len(seen) == 2
    skinny_gemm.linear(x[:1], w, out_dtype)  # "cublas"
    skinny_gemm.linear(torch.cat([x] * 2), w, out_dtype)  # M 6: no entry that large
    assert len(seen) == 2


def test_torch_path_off_the_gpu_is_what_torch_computes():
    from afd.kernels import skinny_gemm
    from afd.models import layers

    x, w = operands(3, 64, 96, torch.bfloat16)
    x, w = x.cpu(), w.cpu()
    assert skinny_gemm.choice(x, w) is None  # a CPU tensor never consults a table
    assert torch.equal(skinny_gemm.linear(x, w), F.linear(x, w))
    assert torch.equal(skinny_gemm.linear(x, w, torch.float32), x.float() @ w.float().t())
    linear = torch.nn.Linear(96, 64, bias=False, dtype=torch.bfloat16)
    assert torch.equal(layers.apply_linear(linear, x), linear(x))


# ---------------------------------------------------------------- on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n, k", [(3648, 2048), (192, 2048), (2048, 4096)])
def test_on_the_gpu_at_decode_shapes_and_in_a_graph(n, k, table_dir):
    from afd.kernels import skinny_gemm

    for m in (1, 4, 16):
        x, w = (t.to(torch.bfloat16) for t in operands(m, n, k, torch.float32, seed=m))
        for chosen in (setting(BLOCK_N=64, BLOCK_K=128), setting(BLOCK_N=16, BLOCK_K=128, SPLIT_K=8, DOT=True)):
            got = skinny_gemm.gemm(x, w, torch.float32, chosen)
            torch.testing.assert_close(got, torch.mm(x, w.t(), out_dtype=torch.float32), rtol=1e-3, atol=1e-2)
    x, w = (t.to(torch.bfloat16) for t in operands(2, n, k, torch.float32))
    write_table(table_dir / "skinny_Test_GPU.json",
                [{"n": n, "k": k, "m": 2, "out": "float32", "setting": setting(SPLIT_K=4, BLOCK_K=128)}])
    eager = skinny_gemm.linear(x, w, torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        skinny_gemm.linear(x, w, torch.float32)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = skinny_gemm.linear(x, w, torch.float32)
    graph.replay()
    assert torch.equal(captured, eager)
