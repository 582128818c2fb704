"""x @ Wᵀ for a few rows (decode's M ≤ 16) as a bandwidth-bound Triton kernel, chosen per shape by a measured table.

At M = 1..16 a GEMM reads all of W for a handful of outputs: its time is W's bytes over the copy rate, or
should be (issue 33: cuBLAS takes ~4x that on the decode step's projections). Each program here owns
BLOCK_N rows of W and streams their K columns in BLOCK_K-wide coalesced loads, `num_stages` deep, against all
M rows of x (small: they stay in L1/L2), accumulating in float32. With SPLIT_K > 1 (small N: too few programs
to fill the GPU) each of SPLIT_K programs per row block takes one slice of K and writes a float32 partial; a
second launch adds the partials in split order, so the same inputs give the same bits every time (no atomics).
DOT multiplies with `tl.dot` (x padded to 16 rows), else with float32 FMAs and a row sum per step.

Whether a shape runs here is measured, never guessed: `bench/kernels/skinny_tune.py` writes
configs/skinny_<DEVICE>.json, mapping (N, K, M, output) to kernel settings or "cublas"; without the file every
shape stays on torch's GEMM. The choice depends on shapes and device only (no host sync): capturable.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from afd.kernels import batch_invariant
from afd.kernels.pdl import gdc_enter, launch_options

MAX_ROWS = 16
CONFIG_DIR = Path(__file__).with_name("configs")
SETTING_KEYS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "DOT", "num_warps", "num_stages")
OUTPUTS = ("input", "float32")  # the output's dtype: x's, or float32 from the accumulator
SUM_BLOCK = 1024
MAX_SPLITS = 64  # partials summed by one unrolled loop


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_xk, stride_wn, stride_om,
                   stride_os, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                   GDC: tl.constexpr = 0):
    gdc_enter(GDC)
    rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rows_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    live_n, live_m = rows_n < N, rows_m < M
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + rows_n[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + rows_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        ks = k + cols
        live_k = ks < k_end
        w = tl.load(w_rows + ks[None, :], mask=live_n[:, None] & live_k[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :].to(tl.int64) * stride_xk, mask=live_m[:, None] & live_k[None, :], other=0.0)
        if DOT:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    out = out_ptr + split.to(tl.int64) * stride_os + rows_m[:, None].to(tl.int64) * stride_om + rows_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live_m[:, None] & live_n[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, total, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr = 0):
    gdc_enter(GDC)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < total
    acc = tl.load(part_ptr + offs, mask=live, other=0.0)
    for split in tl.static_range(1, SPLIT_K):  # in split order: the same bits every run
        acc += tl.load(part_ptr + split * total + offs, mask=live, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=live)


def check_setting(setting: dict) -> None:
    """Raise ValueError unless `setting` is a complete, launchable kernel setting (see SETTING_KEYS)."""
    if not isinstance(setting, dict) or set(setting) != set(SETTING_KEYS):
        raise ValueError(f"a skinny GEMM setting needs exactly the keys {SETTING_KEYS}, got {setting!r}")
    if type(setting["SPLIT_K"]) is not int or not 1 <= setting["SPLIT_K"] <= MAX_SPLITS:
        raise ValueError(f"skinny GEMM SPLIT_K must be an int in 1..{MAX_SPLITS}, got {setting['SPLIT_K']!r}")
    for key in ("BLOCK_N", "BLOCK_K", "num_warps"):
        value = setting[key]
        if type(value) is not int or value < 1 or value & (value - 1):
            raise ValueError(f"skinny GEMM setting {key} must be a power of two >= 1, got {value!r}")
    if setting["BLOCK_N"] < 16 or setting["BLOCK_K"] < 16:
        raise ValueError(f"skinny GEMM BLOCK_N and BLOCK_K must be >= 16, got {setting!r}")
    if type(setting["num_stages"]) is not int or not 1 <= setting["num_stages"] <= 8:
        raise ValueError(f"skinny GEMM num_stages must be an int in 1..8, got {setting['num_stages']!r}")
    if type(setting["DOT"]) is not bool:
        raise ValueError(f"skinny GEMM DOT must be true or false, got {setting['DOT']!r}")


def _out_kind(x: torch.Tensor, out_dtype: torch.dtype | None) -> str:
    if out_dtype is None or out_dtype == x.dtype:
        return "input"
    if out_dtype == torch.float32:
        return "float32"
    raise ValueError(f"skinny GEMM output {out_dtype} for {x.dtype} inputs: only the input's dtype or float32")


def gemm(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None, setting: dict,
         sum_splits: bool = True) -> torch.Tensor:
    """[M, N] = x [M, K] @ weight [N, K]ᵀ by the Triton kernel with `setting`, in `out_dtype` (None: x's).
    `sum_splits=False` (float32 only): the split-K partials unsummed, [S, M, N] (S = 1 without a split)."""
    check_setting(setting)
    if not sum_splits and out_dtype != torch.float32:
        raise ValueError(f"skinny GEMM partials are float32; asked for {out_dtype}")
    kind = _out_kind(x, out_dtype)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny GEMM of x {tuple(x.shape)} and weight {tuple(weight.shape)}: need [M, K] and [N, K]")
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise ValueError(f"skinny GEMM takes bf16 or fp16 x and weight of one dtype, got {x.dtype} and {weight.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    if not 1 <= m <= MAX_ROWS or k < 1:
        raise ValueError(f"skinny GEMM takes 1..{MAX_ROWS} rows and K >= 1, got x {tuple(x.shape)}")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    dtype = x.dtype if kind == "input" else torch.float32
    splits, block_k = setting["SPLIT_K"], setting["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k  # whole blocks: aligned loads per slice
    splits = triton.cdiv(k, k_per_split)  # no empty slices
    target = torch.empty(m, n, dtype=dtype, device=x.device) if splits == 1 else \
        torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    block_m = max(16, triton.next_power_of_2(m)) if setting["DOT"] else triton.next_power_of_2(m)
    grid = (triton.cdiv(n, setting["BLOCK_N"]), splits)
    _skinny_kernel[grid](x, weight, target, m, n, k, k_per_split, x.stride(0), x.stride(1), weight.stride(0),
                         n, m * n, BLOCK_M=block_m, BLOCK_N=setting["BLOCK_N"], BLOCK_K=block_k, DOT=setting["DOT"],
                         num_warps=setting["num_warps"], num_stages=setting["num_stages"],
                         **launch_options(x.device, release_early=False))
    if splits == 1:
        return target if sum_splits else target.unsqueeze(0)
    if not sum_splits:
        return target
    out = torch.empty(m, n, dtype=dtype, device=x.device)
    _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](target, out, m * n, SPLIT_K=splits, BLOCK=SUM_BLOCK,
                                                         **launch_options(out.device))
    return out


def torch_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """What torch computes today: F.linear, or for a float32 output of 16-bit inputs torch.mm's float32
    accumulator (on CUDA; elsewhere the float32 product of the same values)."""
    if _out_kind(x, out_dtype) == "input":
        return F.linear(x, weight)
    if x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return x.float() @ weight.float().t()


# ---------------------------------------------------------------- the measured table
def table_name(device_name: str) -> str:
    return f"skinny_{device_name.replace(' ', '_')}.json"


def read_table(path: Path) -> dict[tuple[int, int, int, str], dict | None]:
    """{(N, K, M, output): setting, or None for torch's GEMM} of a table file; ValueError naming the file if it
    is malformed."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
            raise ValueError('needs an object with an "entries" list')
        table = {}
        for entry in data["entries"]:
            if not isinstance(entry, dict):
                raise ValueError(f"entry {entry!r} is not an object")
            n, k, m, out, setting = (entry.get(key) for key in ("n", "k", "m", "out", "setting"))
            if not all(type(v) is int and v >= 1 for v in (n, k, m)) or m > MAX_ROWS:
                raise ValueError(f"entry {entry!r}: n, k and m must be ints >= 1, m <= {MAX_ROWS}")
            if out not in OUTPUTS:
                raise ValueError(f"entry {entry!r}: out must be one of {OUTPUTS}")
            if setting != "cublas":
                check_setting(setting)
            if (n, k, m, out) in table:
                raise ValueError(f"entry {entry!r} repeats its shape")
            table[(n, k, m, out)] = None if setting == "cublas" else dict(setting)
        return table
    except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"skinny GEMM table {path}: {err}") from err


@functools.lru_cache(maxsize=None)
def device_table(device_name: str) -> dict:
    """The table of the GPU named `device_name` (configs/skinny_<name>.json), empty without one (read once)."""
    path = CONFIG_DIR / table_name(device_name)
    return read_table(path) if path.is_file() else {}


def pick(table: dict, n: int, k: int, m: int, out: str) -> dict | None:
    """The setting for these shapes (pure): the entry of M, else of the nearest larger measured M (its blocks
    cover fewer rows too); None (torch's GEMM) where no entry is, or the entry says "cublas"."""
    if not 1 <= m <= MAX_ROWS:
        return None
    larger = [rows for (en, ek, rows, eo) in table if (en, ek, eo) == (n, k, out) and rows >= m]
    return table[(n, k, min(larger), out)] if larger else None


KERNEL_DEVICES = ("cuda",)  # where a table is consulted (tests add the interpreter's "cpu")


def _device_name(device: torch.device) -> str:
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=4096)
def _choice(device_name: str, n: int, k: int, m: int, out: str) -> dict | None:
    return pick(device_table(device_name), n, k, m, out)


def choice(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> dict | None:
    """The kernel setting for x @ weightᵀ from the table of x's GPU, or None (torch's GEMM): shapes, dtypes and
    the device's name decide, nothing on the device is read."""
    kind = _out_kind(x, out_dtype)
    if (x.device.type not in KERNEL_DEVICES or x.dim() != 2 or weight.dim() != 2 or weight.device != x.device
            or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype
            or x.shape[1] != weight.shape[1] or not 1 <= x.shape[0] <= MAX_ROWS or batch_invariant.enabled()):
        return None  # (batch-invariant mode too: the table's settings differ by row count; torch's GEMM then)
    return _choice(_device_name(x.device), weight.shape[0], weight.shape[1], x.shape[0], kind)


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ weightᵀ in `out_dtype` (None: x's; or float32 of 16-bit inputs): the Triton kernel where this GPU's
    table picks it for these shapes (`choice`), else `torch_linear`. Shapes alone choose: capturable."""
    setting = choice(x, weight, out_dtype)
    return torch_linear(x, weight, out_dtype) if setting is None else gemm(x, weight, out_dtype, setting)


def linear_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`linear(x, weight, torch.float32)` as [S, M, N] float32 partial products over S slices of K, to be added
    in slice order (S = 1: the product itself): a consumer that reads the product anyway (the routing kernel)
    adds the slices where it reads them, and the second launch goes (issue 33). Their sum in slice order is
    `linear`'s result bit for bit."""
    setting = choice(x, weight, torch.float32)
    if setting is None:
        return torch_linear(x, weight, torch.float32).unsqueeze(0)
    return gemm(x, weight, torch.float32, setting, sum_splits=False)


def sum_partials(partials: torch.Tensor) -> torch.Tensor:
    """[S, M, N] partials → [M, N], added in slice order as the kernels add them (the same bits)."""
    total = partials[0].clone()
    for part in partials[1:]:
        total += part
    return total
