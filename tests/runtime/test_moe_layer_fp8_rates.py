"""bench/kernels/moe_layer_fp8.py's operating-point arithmetic without a GPU: the profiler's kernels summed by part of
the layer, and the achieved rates divided by the dense rates measured in the same run."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.kernels import moe_layer_fp8  # noqa: E402


def test_kernel_parts_sums_each_kernel_into_its_part_of_the_layer():
    micros = {"_gate_up_kernel": 600.0, "_down_kernel": 300.0, "_sum_slots_kernel": 40.0, "_quant_kernel": 10.0,
              "_count_kernel": 3.0, "_offsets_kernel": 2.0, "_scatter_kernel": 4.0, "_select_kernel": 5.0,
              "nvjet_tst_128x64_64x8_1x2_h_bz_TNT": 20.0, "Memset (Device)": 1.0, "some_other_kernel": 7.0}
    parts = moe_layer_fp8.kernel_parts(micros)
    assert parts == {"gate_up GEMM": 600.0, "down GEMM": 300.0, "slot sum": 40.0, "act quant": 10.0, "align": 10.0,
                     "routing": 5.0, "router GEMM": 20.0, "other": 7.0}
    assert sum(parts.values()) == pytest.approx(sum(micros.values()))  # every kernel counted once


def test_add_rates_divides_the_achieved_flops_by_the_measured_dense_rates():
    limits = {"fp8_flops": 1.0e15, "bf16_flops": 0.5e15, "copy_bytes_per_s": 3e12}
    row = {"flops": 2.0e12, "fp8_ms": 4.0, "fp8_experts_ms": 2.5, "bf16_experts_ms": 8.0, "byte_floor_ms": 0.5}
    moe_layer_fp8.add_rates(row, limits)
    assert row["fp8_layer_tflops"] == pytest.approx(500.0)  # 2 TFLOP in 4 ms
    assert row["fp8_layer_of_dense"] == pytest.approx(0.5)
    assert row["fp8_experts_of_dense"] == pytest.approx(0.8)
    assert row["bf16_experts_of_dense"] == pytest.approx(0.5)  # 250 TFLOP/s of the bf16 rate's 500
    assert row["fp8_over_byte_floor"] == pytest.approx(8.0)
    assert "before_fp8_layer_of_dense" not in row  # no --before table: no column


def test_print_rates_prints_one_line_per_count_with_and_without_a_before_table(capsys):
    limits = {"fp8_flops": 1.0e15, "bf16_flops": 0.5e15, "copy_bytes_per_s": 3e12}
    rows = [{"tokens": 8192, "flops": 2.0e12, "fp8_ms": 4.0, "fp8_experts_ms": 2.5, "byte_floor_ms": 0.5},
            {"tokens": 16384, "flops": 4.0e12, "fp8_ms": 8.0, "fp8_experts_ms": 5.0, "byte_floor_ms": 0.5,
             "bf16_experts_ms": 16.0, "before_fp8_ms": 10.0}]
    for row in rows:
        moe_layer_fp8.add_rates(row, limits)
    moe_layer_fp8.print_rates("deepseek-v3", rows, limits)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[2].split()[0] == "8192" and lines[3].split()[0] == "16384"
    assert lines[3].split()[-2:] == ["400", "0.40"]  # the before table's 4 TFLOP in 10 ms
