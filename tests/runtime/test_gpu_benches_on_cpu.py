"""A GPU bench run where torch sees no CUDA GPU says so and exits 1, instead of a traceback from deep inside it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPU_BENCHES = ["cluster/afd_decode", "step/attention_split", "kernels/decode_tune", "kernels/fp8_probe",
               "kernels/gemm_invariance", "step/graphs_vs_eager", "step/mixed_step", "step/memory_probe",
               "kernels/mla_decode", "comparisons/moe_deepgemm", "kernels/moe_fp8_spills", "kernels/moe_layer",
               "kernels/moe_layer_fp8", "kernels/moe_small", "kernels/moe_tune", "kernels/pdl_chain", "cluster/plan_gpu",
               "kernels/skinny_tune", "kernels/sparse_mla", "step/step_floor"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: the benches would run")
@pytest.mark.parametrize("name", GPU_BENCHES)
def test_a_gpu_bench_without_a_gpu_exits_with_a_message(name, tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT)])}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    assert f"bench/{name}.py needs a CUDA GPU" in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
