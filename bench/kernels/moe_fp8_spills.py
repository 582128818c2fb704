"""Registers and spills of the FP8 MoE kernels' untuned defaults (before and after session 40) and of the tuned
table's entries at a sample model's shapes, as ptxas reports them for Triton's compiled kernels.

    python3 bench/kernels/moe_fp8_spills.py --shape deepseek-v3     # prints a line per entry, writes $OUT/moe_fp8_spills-SHAPE.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import require_cuda, write_json  # noqa: E402
from bench.harness.shapes import MOE_SHAPES  # noqa: E402
from bench.kernels.moe_tune import COMPILE_ROUTED, Problem, random_experts  # noqa: E402

# FP8_DEFAULT_CONFIGS' tall entries before session 40 (gate_up in one dot over a BM×256 float32 tile)
BEFORE = {
    1024: {"BLOCK_M": 64, "gate_up": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "TMA": True,
                                      "ONE_DOT": True},
           "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "TMA": True}},
    4096: {"BLOCK_M": 128, "gate_up": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "TMA": True,
                                       "ONE_DOT": True},
           "down": {"BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "TMA": True}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="deepseek-v3", choices=sorted(MOE_SHAPES))
    args = parser.parse_args()
    require_cuda(__file__)
    from afd.kernels.moe import CONFIG_DIR, FP8_DEFAULT_CONFIGS, config_name

    shape = MOE_SHAPES[args.shape]
    gate_up, down, scales = random_experts(shape, True, COMPILE_ROUTED)
    name = config_name(shape["routed"] + shape["shared"], shape["hidden"], shape["inter"],
                       torch.cuda.get_device_name(), True)
    path = CONFIG_DIR / name
    tables = {"defaults before": BEFORE, "defaults now": FP8_DEFAULT_CONFIGS}
    if path.is_file():
        tables["tuned"] = {int(t): cfg for t, cfg in json.loads(path.read_text())["configs"].items()}
    problem = Problem(gate_up, down, shape["shared"], shape["top_k"], 64, scales=scales)
    rows = []
    for table_name, table in tables.items():
        for tokens, entry in sorted(table.items()):
            for kernel in ("gate_up", "down"):
                binary = problem.launcher(kernel, entry["BLOCK_M"], entry[kernel])()
                torch.cuda.synchronize()
                rows.append({"table": table_name, "tokens": tokens, "kernel": kernel, "settings": entry[kernel],
                             "layout_m": entry["BLOCK_M"], "registers": binary.n_regs, "spills": binary.n_spills})
                print(f"{table_name:>15} {tokens:>5} {kernel:>7}: {binary.n_regs} registers, {binary.n_spills} "
                      f"spilled ({entry[kernel]})", flush=True)
    write_json(f"moe_fp8_spills-{args.shape}", rows)


if __name__ == "__main__":
    main()
