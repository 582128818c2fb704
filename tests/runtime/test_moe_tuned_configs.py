"""The MoE kernels' tuned tables and the packed gate-on-attention rows: pure logic, no GPU."""

import json

import pytest
import torch

from afd.connector.tensors import pack_rows, unpack_rows
from afd.connector.wire import ProtocolError
from afd.kernels.moe import (CONFIG_DIR, DEFAULT_CONFIGS, FP8_DEFAULT_CONFIGS, config_name, config_table,
                             pick_config)
from afd.kernels import moe_launch
from afd.kernels.moe_launch import kernel_settings

KERNEL_KEYS = {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}
OPTIONAL_KEYS = {"BLOCK_M", "GROUP_M", "TMA", "GATHER", "ONE_DOT", "HALVES", "PERSISTENT", "MAX_REGS"}  # newer
# tables: a kernel's own tile height, program order, TMA loads, gate_up's rows pre-gathered, gate_up in one dot or in
# two half-block passes, a persistent grid, a register cap


def assert_kernel_entry(kernel: dict, layout_m: int, fp8: str = "") -> None:
    """`fp8`: the kernel's name when the table is for FP8 experts (BLOCK_K divides 128; gate_up's BLOCK_N is a
    multiple of 128)."""
    assert KERNEL_KEYS <= set(kernel) <= KERNEL_KEYS | OPTIONAL_KEYS
    if fp8:
        assert 128 % kernel["BLOCK_K"] == 0
        assert fp8 != "gate_up" or kernel["BLOCK_N"] % 128 == 0
    block_m = kernel.get("BLOCK_M", layout_m)
    assert block_m >= 16 and layout_m % block_m == 0  # a kernel tile lies inside one layout tile: one expert
    assert isinstance(kernel.get("GROUP_M", 0), int) and kernel.get("GROUP_M", 0) >= 0
    assert isinstance(kernel.get("TMA", False), bool) and isinstance(kernel.get("GATHER", False), bool)
    assert kernel.get("ONE_DOT", False) in (False, kernel.get("TMA", False))  # one dot needs TMA
    assert not (kernel.get("ONE_DOT", False) and kernel.get("HALVES", False))
    persistent = kernel.get("PERSISTENT", 0)
    assert isinstance(persistent, int) and not isinstance(persistent, bool) and persistent >= 0
    kernel_settings(kernel, layout_m, bool(fp8), fp8)  # and what the launcher itself refuses


def test_pick_config_takes_the_nearest_token_count():
    table = {1: "a", 64: "b", 1024: "c"}
    assert [pick_config(table, t) for t in (1, 2, 32, 33, 64, 500, 545, 5000)] == ["a", "a", "a", "b", "b", "b", "c", "c"]


def test_an_unknown_device_gets_the_defaults():
    assert config_table(66, 2048, 1408, "Some GPU") is DEFAULT_CONFIGS


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("E*.json")), ids=lambda p: p.name)
def test_every_committed_table_is_complete(path):
    """Every MoE table (E….json; the skinny GEMM's table beside them is tested with the skinny GEMM)."""
    document = json.loads(path.read_text())
    experts, hidden, inter = (int(part[1:]) for part in path.stem.split("_")[:3])
    fp8 = document.get("fp8", False)
    assert config_name(experts, hidden, inter, document["device"], fp8) == path.name
    table = config_table(experts, hidden, inter, document["device"], fp8)
    assert table is not DEFAULT_CONFIGS and table is not FP8_DEFAULT_CONFIGS
    assert 1 in table or fp8  # FP8 tables are tuned from 64 tokens; the nearest row serves fewer
    for tokens, entry in table.items():
        assert entry["BLOCK_M"] in (16, 32, 64, 128), tokens
        assert_kernel_entry(entry["gate_up"], entry["BLOCK_M"], "gate_up" if fp8 else "")
        assert_kernel_entry(entry["down"], entry["BLOCK_M"], "down" if fp8 else "")
        assert not {"GATHER", "ONE_DOT", "HALVES"} & set(entry["down"]), tokens  # gate_up's options


def test_defaults_are_complete():
    for entry in DEFAULT_CONFIGS.values():
        assert set(entry["gate_up"]) == KERNEL_KEYS and set(entry["down"]) == KERNEL_KEYS
    for entry in FP8_DEFAULT_CONFIGS.values():
        assert_kernel_entry(entry["gate_up"], entry["BLOCK_M"], "gate_up")
        assert_kernel_entry(entry["down"], entry["BLOCK_M"], "down")


def fp8_tile_registers(kernel: str, entry: dict) -> int:
    from afd.kernels.moe_launch import fp8_accumulator_registers

    cfg = entry[kernel]
    return fp8_accumulator_registers(kernel, cfg.get("BLOCK_M", entry["BLOCK_M"]), cfg["BLOCK_N"], cfg["num_warps"],
                                     cfg.get("ONE_DOT", False), cfg.get("HALVES", False))


@pytest.mark.parametrize("tokens", sorted(FP8_DEFAULT_CONFIGS))
def test_fp8_defaults_keep_their_accumulators_in_registers(tokens):
    """An FP8 tile holds each step's scaled product beside its accumulators: the defaults stay at 128 float32
    registers a thread or fewer (the tall ones of before held 256 and ran slower than bf16)."""
    entry = FP8_DEFAULT_CONFIGS[tokens]
    assert fp8_tile_registers("gate_up", entry) <= 128 and fp8_tile_registers("down", entry) <= 128


def test_fp8_register_count_of_a_tile():
    from afd.kernels.moe_launch import fp8_accumulator_registers

    assert fp8_accumulator_registers("down", 128, 256, 8) == 2 * 128 * 256 // 256
    assert fp8_accumulator_registers("gate_up", 64, 128, 4) == 3 * 64 * 128 // 128
    assert fp8_accumulator_registers("gate_up", 64, 128, 4, one_dot=True) == 4 * 64 * 128 // 128
    # HALVES: one BM×BN accumulator, its product and the first half's act (BM×BN/2)
    assert fp8_accumulator_registers("gate_up", 64, 128, 4, halves=True) == 64 + 64 + 32
    assert fp8_accumulator_registers("gate_up", 128, 128, 8, halves=True) == 160


@pytest.mark.parametrize("key", ["LAG", "K_PAIRS"])
def test_an_entry_with_a_removed_fp8_variant_is_refused_by_name(key):
    """Session 42's LAG / K_PAIRS kernel variants wrote wrong rows on the H200 and were removed (issue 32): a table
    entry that still asks for one is refused, naming the key, not run silently as the base kernel."""
    entry = {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, key: True}
    with pytest.raises(ValueError, match=f"down table entry has {key}: the FP8 {key} kernel variant was removed"):
        kernel_settings(entry, 64, fp8=True, kernel="down")
    with pytest.raises(ValueError, match=f"drop {key}"):
        kernel_settings({**entry, key: False}, 64)  # even off: the key itself is gone


def test_fp8_experts_have_tables_of_their_own():
    assert config_name(257, 7168, 2048, "NVIDIA H200", fp8=True) == "E257_H7168_I2048_fp8_NVIDIA_H200.json"
    assert config_table(128, 2048, 768, "Some GPU", fp8=True) is FP8_DEFAULT_CONFIGS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_packed_rows_round_trip(dtype):
    hidden = torch.randn(5, 6).to(dtype)
    logits = torch.randn(5, 3)
    packed = pack_rows(hidden, logits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 6 * dtype.itemsize + 12)
    got_hidden, got_logits = unpack_rows(packed, 6, dtype, 3)
    assert torch.equal(got_hidden, hidden) and torch.equal(got_logits, logits)


def test_packed_rows_of_the_wrong_width_are_refused():
    packed = pack_rows(torch.randn(2, 4).bfloat16(), torch.randn(2, 3))
    with pytest.raises(ProtocolError, match="packed rows"):
        unpack_rows(packed, 4, torch.bfloat16, 4)


def test_a_devices_table_comes_from_its_name_looked_up_once(monkeypatch):
    from afd.kernels import moe

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: asked.append(index) or "NVIDIA H200")
    moe._device_name.cache_clear()
    try:
        device = torch.device("cuda", 3)  # never touched: only its index is read
        tuned = moe.config_table(66, 2048, 1408, "NVIDIA H200")
        assert moe.device_table(device, 66, 2048, 1408) is tuned is not DEFAULT_CONFIGS
        assert moe.device_table(device, 1, 2, 3) is DEFAULT_CONFIGS
        assert asked == [3]
    finally:
        moe._device_name.cache_clear()


class SharedMemoryKernel:
    """Stands in for a Triton kernel whose launch needs more shared memory than the GPU has above `fits` stages."""

    __name__ = "down_kernel"

    def __init__(self, fits: int):
        self.fits, self.launched = fits, []

    def __getitem__(self, grid):
        def run(*args, num_stages, **constants):
            if num_stages > self.fits:
                raise moe_launch.OutOfResources(100_000 * num_stages, 232_448, "shared memory")
            self.launched.append(num_stages)
            return "compiled"
        return run


@pytest.mark.skipif(moe_launch.OutOfResources == (), reason="needs Triton's OutOfResources")
def test_an_entry_too_big_for_the_gpus_shared_memory_runs_with_fewer_stages_and_remembers(monkeypatch, caplog):
    """Session 42 on the H200: two shipped bf16 down entries (128x256, 4 stages) needed 327,712 bytes once shared
    experts kept float32 rows; the launch raised at warm-up. Now one stage fewer at a time, logged once."""
    monkeypatch.setattr(moe_launch, "_FITTING_STAGES", {})
    cfg = kernel_settings({"BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}, 128)
    kernel = SharedMemoryKernel(fits=2)
    device = torch.device("cpu")
    assert moe_launch.launch(kernel, (), 256, 8, 128, cfg, device, SHARED_APART=True) == "compiled"
    assert moe_launch.launch(kernel, (), 256, 8, 128, cfg, device, SHARED_APART=True) == "compiled"
    assert kernel.launched == [2, 2]  # the second launch starts at the depth that fit
    assert sum("num_stages 3 instead of 4" in r.getMessage() or "num_stages 2 instead of 3" in r.getMessage()
               for r in caplog.records) == 2
    with pytest.raises(moe_launch.OutOfResources):  # nothing fits: the error stands
        moe_launch.launch(SharedMemoryKernel(fits=0), (), 256, 8, 128, cfg, device, SHARED_APART=False)
