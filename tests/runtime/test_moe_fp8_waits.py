"""bench/kernels/moe_fp8_waits.py compiles the FP8 MoE kernels for Hopper (sm_90a) on a machine without a GPU: each K loop's
wgmma dots and waits, registers, spills and shared memory of the session-40 winners' settings."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def hopper_compiler_missing() -> bool:
    try:
        import triton
    except ImportError:
        return True
    return not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


@pytest.mark.skipif(hopper_compiler_missing(), reason="needs Triton with its NVIDIA backend (ptxas)")
def test_compiled_for_hopper_every_fp8_dot_is_waited_for_in_its_step_and_nothing_spills():
    """Every dot of the K loop is followed by a wait 0 (the block scales are applied to each step's product, so the
    tensor cores idle during the promotion: the compute-bound gap of issue 32); no setting spills, and each fits an
    H200's shared memory (227 KiB a block)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels" / "moe_fp8_waits.py"), "--json"], capture_output=True,
                          text=True, env=env, timeout=600, check=True)
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert {row["kernel"] for row in rows} == {"gate_up", "down"}
    assert {row["one_dot"] for row in rows if row["kernel"] == "gate_up"} == {False, True}
    assert any(row.get("halves") for row in rows)
    for row in rows:
        dots = 2 if row["kernel"] == "gate_up" and not row["one_dot"] and not row.get("halves") else 1  # the first K
        # loop: HALVES' passes have one dot each
        assert row["loop"] == " ".join(["dot wait0"] * dots), row
        assert row["stack"] == 0 and 0 < row["reg"] <= 255 and 0 < row["shared_bytes"] <= 227 * 1024, row
