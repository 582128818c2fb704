"""The FP8 MoE kernels' LAG variant (each step's second dot added one step late, so its MMA can overlap the
promotion) and K_PAIRS variant (two K steps a loop step, the second's dot promoted in the next) write the same bits
as the kernels without them: same terms, same scales, same order; and compiled for Hopper, their last dots are
left in flight.

The kernels run on a CUDA GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1, as `make test-kernels` sets);
else those tests skip. Weights and activations get a different magnitude per 128-block, so a scale of the wrong
block or step shows.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernel_device import KERNEL_DTYPES, NO_KERNEL_DEVICE, kernel_device

from afd.kernels.fp8_blocks import quantize_block_fp8

DEVICE = kernel_device()
DTYPE = KERNEL_DTYPES.get(DEVICE)
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=NO_KERNEL_DEVICE)

ROUTED, NUM_SHARED, TOP_K = 6, 1, 2


def blocky(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """Random normal values whose 128×128 blocks (of the last two dims) differ in magnitude by up to 2^±3."""
    values = torch.randn(*shape, generator=generator)
    blocks = (-(-shape[-2] // 128), -(-shape[-1] // 128))
    factors = 2.0 ** torch.randint(-3, 4, (*shape[:-2], *blocks), generator=generator).float()
    return values * factors.repeat_interleave(128, -2)[..., : shape[-2], :].repeat_interleave(128, -1)[..., : shape[-1]]


def routing(tokens: int, layout_m: int, generator: torch.Generator):
    from afd.kernels import moe_align

    ids = torch.rand(tokens, ROUTED, generator=generator).topk(TOP_K, dim=-1).indices.to(DEVICE)
    weights = torch.rand(tokens, TOP_K, generator=generator).to(DTYPE).to(DEVICE)
    return moe_align.align(ids, NUM_SHARED, ROUTED + NUM_SHARED, layout_m), weights


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, on the CPU (e4m3 and float32 compared bit for bit, NaN or not)."""
    return tensor.contiguous().view(torch.uint8).cpu()


def run_gate_up(tokens: int, hidden: int, inter: int, layout_m: int, cfg: dict, seed: int = 0):
    """(act bytes, act_scale bytes) of FP8 gate_up over random blocky experts."""
    from afd.kernels import fp8_gemm, moe_triton

    generator = torch.Generator().manual_seed(seed)
    w, w_scale = quantize_block_fp8(blocky(ROUTED + NUM_SHARED, 2 * inter, hidden, generator=generator) * 0.05)
    x, x_scale = fp8_gemm.per_token_group_quant(blocky(tokens, hidden, generator=generator).to(DTYPE).to(DEVICE))
    layout, _ = routing(tokens, layout_m, generator)
    rows, slots = layout.pairs.shape[0], TOP_K + NUM_SHARED
    act = torch.zeros(rows, inter, dtype=torch.float8_e4m3fn, device=DEVICE)
    act_scale = torch.zeros(rows, inter // 128, device=DEVICE)
    x_rows = torch.zeros(rows, hidden, dtype=x.dtype, device=DEVICE)
    moe_triton.launch_gate_up(x, w.to(DEVICE), act, layout, tokens * slots, slots, layout_m, cfg, x_rows, x_scale,
                              w_scale.to(DEVICE), act_scale)
    return bits(act), bits(act_scale)


def run_down(tokens: int, hidden: int, inter: int, layout_m: int, cfg: dict, seed: int = 0):
    """The output bytes of FP8 down (routed pairs and the shared experts' float32 rows) over random inputs."""
    from afd.kernels import moe_triton

    generator = torch.Generator().manual_seed(seed)
    w, w_scale = quantize_block_fp8(blocky(ROUTED + NUM_SHARED, hidden, inter, generator=generator) * 0.05)
    layout, weights = routing(tokens, layout_m, generator)
    rows = layout.pairs.shape[0]
    act = (blocky(rows, inter, generator=generator) * 50).clamp(-448, 448).to(torch.float8_e4m3fn).to(DEVICE)
    act_scale = (torch.rand(rows, inter // 128, generator=generator) * 1e-2).to(DEVICE)
    out = torch.zeros(tokens * TOP_K, hidden, dtype=DTYPE, device=DEVICE)
    shared_out = torch.zeros(tokens * NUM_SHARED, hidden, device=DEVICE)
    moe_triton.launch_down(act, w.to(DEVICE), out, layout, weights, tokens * (TOP_K + NUM_SHARED), TOP_K,
                           TOP_K + NUM_SHARED, layout_m, cfg, act_scale, w_scale.to(DEVICE), shared_out)
    assert out.float().abs().sum() > 0 and shared_out.abs().sum() > 0  # the comparison is of real outputs
    return bits(out), bits(shared_out)


def kernel(block_n=128, block_k=128, warps=4, **keys):
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": 3, **keys}


VARIANTS = {"lag": {"LAG": True, "ONE_DOT": False}, "k-pairs": {"K_PAIRS": True}}  # LAG takes ONE_DOT off: same bits
GATE_UP = {  # id → (layout BLOCK_M, gate_up entry without a variant)
    "pointers": (16, kernel()),
    "pointers-gather-64": (64, kernel(GATHER=True)),
    "tma-half-tiles-k64": (32, kernel(block_k=64, TMA=True, BLOCK_M=16)),
    "tma-wide-persistent": (32, kernel(256, TMA=True, PERSISTENT=1, GROUP_M=2)),
    "one-dot": (32, kernel(TMA=True, ONE_DOT=True)),
    "one-dot-gather-k32": (16, kernel(block_k=32, TMA=True, GATHER=True, ONE_DOT=True)),
    "one-dot-wide": (16, kernel(256, TMA=True, ONE_DOT=True, warps=8)),
}


@needs_kernels
@pytest.mark.parametrize("tokens, hidden", [(1, 128), (37, 320), (130, 256)])  # 128: a single K step (BLOCK_K 128)
@pytest.mark.parametrize("name", sorted(GATE_UP))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gate_up_variants_write_the_same_bits(variant, name, tokens, hidden):
    """hidden 128: a single K step (BLOCK_K 128); 320: three (K_PAIRS: an odd one, with a partial 128-block)."""
    layout_m, cfg = GATE_UP[name]
    inter = 2 * cfg["BLOCK_N"] if cfg["BLOCK_N"] == 128 else 384  # 384 over BLOCK_N 256: a partial column block
    base = run_gate_up(tokens, hidden, inter, layout_m, cfg)
    lagged = run_gate_up(tokens, hidden, inter, layout_m, {**cfg, **VARIANTS[variant]})
    assert base[0].any() and base[1].any()
    assert torch.equal(base[0], lagged[0]) and torch.equal(base[1], lagged[1])


DOWN = {  # id → (layout BLOCK_M, down entry without LAG)
    "pointers-32": (16, kernel(32)),
    "pointers-64-k64": (32, kernel(64, 64, BLOCK_M=16)),
    "tma-128": (32, kernel(TMA=True)),
    "tma-256-persistent": (16, kernel(256, TMA=True, PERSISTENT=1, GROUP_M=2, warps=8)),
    "pointers-256": (64, kernel(256)),
}


@needs_kernels
@pytest.mark.parametrize("tokens, hidden, inter", [(1, 320, 128), (37, 320, 256), (130, 512, 384)])
@pytest.mark.parametrize("name", sorted(DOWN))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_down_variants_write_the_same_bits(variant, name, tokens, hidden, inter):
    """hidden 320: a column block (and a half of one) past the last weight row; inter 128: a single K step, 384:
    three (K_PAIRS: an odd one)."""
    layout_m, cfg = DOWN[name]
    base = run_down(tokens, hidden, inter, layout_m, cfg)
    lagged = run_down(tokens, hidden, inter, layout_m, {**cfg, **{k: v for k, v in VARIANTS[variant].items()
                                                                 if k != "ONE_DOT"}})
    assert torch.equal(base[0], lagged[0]) and torch.equal(base[1], lagged[1])


def test_lag_settings_are_checked():
    from afd.kernels.moe_launch import kernel_settings

    assert kernel_settings(kernel(LAG=True), 64, fp8=True, kernel="down")["LAG"] is True
    assert "LAG" not in kernel_settings(kernel(), 64, fp8=True, kernel="down")  # older tables: off, no key added
    with pytest.raises(ValueError, match="not FP8; drop LAG"):
        kernel_settings(kernel(LAG=True), 64, fp8=False, kernel="gate_up")
    with pytest.raises(ValueError, match="LAG 1 must be true or false"):
        kernel_settings(kernel(LAG=1), 64, fp8=True, kernel="gate_up")
    with pytest.raises(ValueError, match="needs BLOCK_N from 32 to 256"):
        kernel_settings(kernel(512, LAG=True), 64, fp8=True, kernel="down")
    with pytest.raises(ValueError, match="needs BLOCK_N from 32 to 256"):
        kernel_settings(kernel(16, LAG=True), 64, fp8=True, kernel="down")
    with pytest.raises(ValueError, match="LAG needs two dots a step and ONE_DOT makes one"):
        kernel_settings(kernel(TMA=True, ONE_DOT=True, LAG=True), 64, fp8=True, kernel="gate_up")
    kernel_settings(kernel(256, LAG=True), 64, fp8=True, kernel="gate_up")  # gate_up splits gate from up: any N
    assert kernel_settings(kernel(TMA=True, ONE_DOT=True, K_PAIRS=True), 64, fp8=True, kernel="gate_up")["K_PAIRS"]
    with pytest.raises(ValueError, match="LAG and K_PAIRS lay the loop out in two different ways"):
        kernel_settings(kernel(LAG=True, K_PAIRS=True), 64, fp8=True, kernel="down")
    with pytest.raises(ValueError, match="K_PAIRS overlaps .* not FP8; drop K_PAIRS"):
        kernel_settings(kernel(K_PAIRS=True), 64, fp8=False, kernel="down")
    with pytest.raises(ValueError, match="K_PAIRS 'yes' must be true or false"):
        kernel_settings(kernel(K_PAIRS="yes"), 64, fp8=True, kernel="down")


@needs_kernels
def test_lag_is_refused_on_bf16_experts_at_launch():
    from afd.kernels import moe_align, moe_triton

    layout = moe_align.align(torch.zeros(1, 1, dtype=torch.long, device=DEVICE), 0, 1, 16)
    with pytest.raises(ValueError, match="LAG overlaps FP8's block-scale promotion"):
        moe_triton.launch_down(torch.zeros(16, 128, dtype=DTYPE, device=DEVICE),
                               torch.zeros(1, 64, 128, dtype=DTYPE, device=DEVICE),
                               torch.zeros(1, 64, dtype=DTYPE, device=DEVICE), layout,
                               torch.ones(1, 1, dtype=DTYPE, device=DEVICE), 1, 1, 1, 16, kernel(64, LAG=True))


def test_lag_registers_count_the_kept_product():
    from afd.kernels.moe_launch import fp8_accumulator_registers

    assert fp8_accumulator_registers("down", 64, 128, 4, lag=True) == 5 * 64 * 128 // (2 * 128)
    assert fp8_accumulator_registers("gate_up", 64, 128, 8, lag=True) == 5 * 64 * 128 // 256
    assert fp8_accumulator_registers("gate_up", 64, 128, 8, one_dot=True, lag=True) == 5 * 64 * 128 // 256
    assert fp8_accumulator_registers("down", 64, 128, 4, k_pairs=True) == 3 * 64 * 128 // 128
    assert fp8_accumulator_registers("gate_up", 64, 128, 8, one_dot=True, k_pairs=True) == 6 * 64 * 128 // 256
    assert fp8_accumulator_registers("down", 64, 128, 4) == 2 * 64 * 128 // 128  # unchanged without either


def hopper_compiler_missing() -> bool:
    try:
        import triton
    except ImportError:
        return True
    return not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


@pytest.mark.skipif(hopper_compiler_missing(), reason="needs Triton with its NVIDIA backend (ptxas)")
def test_compiled_for_hopper_the_lagged_dot_stays_in_flight():
    """bench/moe_fp8_waits.py compiles the kernels for sm_90a (a process without TRITON_INTERPRET): without a variant
    every dot is followed by a wait 0 in the K loop; with LAG or K_PAIRS the step's last dots are not; nothing
    spills and the shared memory fits an H200's."""
    root = Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(root / "bench" / "moe_fp8_waits.py"), "--json"], capture_output=True,
                          text=True, env=env, timeout=600, check=True)
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert {row["lag"] for row in rows} == {False, True} and {row["k_pairs"] for row in rows} == {False, True}
    for row in rows:
        if row["lag"] or row["k_pairs"]:  # the step's last dot(s): no wait after them in the loop
            assert row["loop"] in ("dot wait0 dot", "dot wait0 dot wait0 dot dot"), row
        else:
            assert row["loop"] in ("dot wait0", "dot wait0 dot wait0"), row
        assert row["stack"] == 0 and row["reg"] <= 255 and row["shared_bytes"] <= 227 * 1024, row


def bench_module(name: str):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_the_fp8_tuner_tries_the_variants_where_async_dots_are_possible(block_m, monkeypatch):
    """bench/moe_tune.py --fp8 --variants: LAG and K_PAIRS on tiles of 64+ rows (LAG never with ONE_DOT, K_PAIRS one
    stage fewer), every candidate a valid setting whose accumulators fit; the other candidates carry neither key
    (tables keep their form); without --variants (the default: on the H200 they wrote other bits) none; bf16 never
    gets them."""
    from afd.kernels.moe_launch import fp8_accumulator_registers, kernel_settings

    moe_tune = bench_module("moe_tune")
    assert moe_tune.TRY_VARIANTS == [False]  # off unless asked
    for kernel_name in moe_tune.KERNELS:
        monkeypatch.setattr(moe_tune, "TRY_VARIANTS", [True])
        space = moe_tune.candidates(kernel_name, block_m, True, fp8=True)
        lagged = [cfg for cfg in space if "LAG" in cfg]
        paired = [cfg for cfg in space if "K_PAIRS" in cfg]
        assert all(cfg["LAG"] is True and not cfg.get("ONE_DOT") for cfg in lagged)
        assert all(cfg["K_PAIRS"] is True and cfg["num_stages"] in (2, 3) for cfg in paired)
        if block_m < moe_tune.LAG_MIN_BLOCK_M:
            assert not lagged and not paired
        elif block_m == 64:  # the compute-bound sizes' tiles (session 40's winners)
            assert lagged and all("LAG" in moe_tune.describe_loads(cfg) for cfg in lagged)
            assert paired and all("K_PAIRS" in moe_tune.describe_loads(cfg) for cfg in paired)
        for cfg in space:
            kernel_settings(cfg, block_m, fp8=True, kernel=kernel_name)
            assert fp8_accumulator_registers(kernel_name, block_m, cfg["BLOCK_N"], cfg["num_warps"],
                                             cfg.get("ONE_DOT", False), cfg.get("LAG", False),
                                             cfg.get("K_PAIRS", False)) <= 192
        monkeypatch.setattr(moe_tune, "TRY_VARIANTS", [False])
        assert moe_tune.candidates(kernel_name, block_m, True, fp8=True) == [
            cfg for cfg in space if "LAG" not in cfg and "K_PAIRS" not in cfg]
        monkeypatch.setattr(moe_tune, "TRY_VARIANTS", [True])
        assert not [cfg for cfg in moe_tune.candidates(kernel_name, block_m, True)
                    if "LAG" in cfg or "K_PAIRS" in cfg]  # bf16: never


def test_the_layer_bench_turns_every_fp8_default_into_valid_variant_entries():
    from afd.kernels.moe import FP8_DEFAULT_CONFIGS
    from afd.kernels.moe_launch import kernel_settings

    moe_layer_fp8 = bench_module("moe_layer_fp8")
    for entry in FP8_DEFAULT_CONFIGS.values():
        lagged = moe_layer_fp8.lag_entry(entry)
        assert lagged["gate_up"]["LAG"] and lagged["down"]["LAG"] and "ONE_DOT" not in lagged["gate_up"]
        assert {key: value for key, value in lagged["down"].items() if key != "LAG"} == entry["down"]
        for kernel_name in ("gate_up", "down"):
            kernel_settings(lagged[kernel_name], lagged["BLOCK_M"], fp8=True, kernel=kernel_name)
        paired = moe_layer_fp8.k_pairs_entry(entry)
        assert paired["gate_up"]["K_PAIRS"] and paired["down"]["K_PAIRS"] and paired["gate_up"]["num_stages"] == 2
        for kernel_name in ("gate_up", "down"):
            kernel_settings(paired[kernel_name], paired["BLOCK_M"], fp8=True, kernel=kernel_name)
    wide = {"BLOCK_M": 64, "gate_up": entry["gate_up"], "down": {**entry["down"], "BLOCK_N": 512}}
    assert "LAG" not in moe_layer_fp8.lag_entry(wide)["down"]  # halves past one weight block: left as it was
