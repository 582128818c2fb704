"""A GPU bench run where torch sees no CUDA GPU says so and exits 1, instead of a traceback from deep inside it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPU_BENCHES = ["afd_decode", "attention_split", "decode_tune", "fp8_probe", "gemm_invariance", "graphs_vs_eager",
               "mixed_step", "memory_probe", "mla_decode", "moe_deepgemm", "moe_fp8_spills", "moe_layer", "moe_layer_fp8",
               "moe_small", "moe_tune", "pdl_chain", "plan_gpu", "skinny_tune", "step_floor"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: the benches would run")
@pytest.mark.parametrize("name", GPU_BENCHES)
def test_a_gpu_bench_without_a_gpu_exits_with_a_message(name, tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT)])}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    assert f"bench/{name}.py needs a CUDA GPU" in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
