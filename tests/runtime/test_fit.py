"""`afd plan --fit`: per-rank sizes from the runtime's own model code, the samples' sizing, refusals."""

import json
import re
from pathlib import Path

import pytest
import yaml

from afd.planner.fit import fit, render_fit

ROOT = Path(__file__).resolve().parents[2]
V3_CONFIG = ROOT / "docs/models/DeepSeek-V3.config.json"
GPU_SAMPLE = ROOT / "crds/samples/gpu-nccl-deepseek-v3-fp8.yaml"
CPU_SAMPLE = ROOT / "crds/samples/cpu-zmq-tiny-deepseek-v3.yaml"
V32_CONFIG = ROOT / "docs/models/DeepSeek-V3.2.config.json"
V32_GPU_SAMPLE = ROOT / "crds/samples/gpu-nccl-deepseek-v32-fp8.yaml"
V32_CPU_SAMPLE = ROOT / "crds/samples/cpu-zmq-tiny-deepseek-v32.yaml"


def test_the_deepseek_v3_gpu_sample_carries_its_current_sizing_table():
    report = fit(json.loads(V3_CONFIG.read_text()), yaml.safe_load(GPU_SAMPLE.read_text()),
                 model_name="docs/models/DeepSeek-V3.config.json")
    assert not report.refused
    table = render_fit(report).splitlines()[2:]
    comment = [line[1:].removeprefix("   ") for line in GPU_SAMPLE.read_text().splitlines() if line.startswith("#")]
    start = comment.index(table[0])
    assert comment[start:start + len(table)] == table
    attention, shard0, _ = report.ranks
    # 32 of 256 routed experts x 58 MoE layers x 3 x 7168 x 2048 FP8 bytes, plus the 3 dense layers on shard 0
    assert 32 * 58 * 3 * 7168 * 2048 < shard0.weight_bytes < 32 * 58 * 3 * 7168 * 2048 + 2.2e9
    assert attention.kv_bytes_per_token == 61 * (512 + 64) * 2  # MLA latent + rotary key, bf16


def test_the_deepseek_v32_gpu_sample_carries_its_current_sizing_table_with_the_index_cache():
    report = fit(json.loads(V32_CONFIG.read_text()), yaml.safe_load(V32_GPU_SAMPLE.read_text()),
                 model_name="docs/models/DeepSeek-V3.2.config.json")
    assert not report.refused
    table = render_fit(report).splitlines()[2:]
    comment = [line[1:].removeprefix("   ") for line in V32_GPU_SAMPLE.read_text().splitlines() if line.startswith("#")]
    start = comment.index(table[0])
    assert comment[start:start + len(table)] == table
    attention = report.ranks[0]
    assert attention.kv_bytes_per_token == 61 * (512 + 64 + 128) * 2  # MLA latent + rotary key + index key, bf16
    v3 = fit(json.loads(V3_CONFIG.read_text()), yaml.safe_load(GPU_SAMPLE.read_text())).ranks[0]
    assert attention.kv_tokens < v3.kv_tokens * 0.83  # the index keys' 22% more bytes a token, and the indexer


def test_the_tiny_v32_cpu_sample_fits_its_pods(tmp_path):
    from afd.checkpoint_tools.tiny import make_tiny_model

    path = make_tiny_model("deepseek_v32", tmp_path / "v32")
    report = fit(json.loads(Path(path, "config.json").read_text()), yaml.safe_load(V32_CPU_SAMPLE.read_text()))
    assert [r.verdict for r in report.ranks] == ["fits", "fits"]
    assert report.ranks[0].kv_bytes_per_token == 3 * (32 + 8 + 32) * 4  # float32 latent + rotary + index key


def test_dequantized_deepseek_v3_is_refused_on_the_same_gpus(tmp_path):
    from tests.runtime.test_generate_cli import afd

    config = json.loads(V3_CONFIG.read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = afd("plan", "--fit", GPU_SAMPLE, "--model-config", tmp_path)
    assert done.returncode == 1, done.stderr
    refusal = r"ffn shard 0 of 8: 155\.\d\d GiB weights .* > 140\.4 GiB of the NVIDIA-H200"
    assert re.search(refusal, done.stdout), done.stdout


def test_fit_counts_what_the_loader_holds(checkpoints):
    """GPU sizing of the tiny FP8 V3 equals the bytes load_model(keep_fp8=True) holds, per role and shard."""
    from afd.models.loader import load_model

    path = str(checkpoints["deepseek_v3_fp8"])
    cr = {"spec": {"attention": {"ranks": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}},
                   "ffn": {"ranks": 1, "expertParallel": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}},
                   "afd": {"dtype": "float32", "computeGateOnAttention": True}}}
    report = fit(json.loads(Path(path, "config.json").read_text()), cr, gpu_memory_bytes=1 << 30)
    attention, shard0, shard1 = report.ranks
    held = load_model(path, "attention", True, keep_fp8=True).resident_bytes
    assert attention.weight_bytes + attention.scale_bytes == held
    for rank, shard in ((shard0, 0), (shard1, 1)):
        held = load_model(path, "ffn", True, shard=(shard, 2), keep_fp8=True).resident_bytes
        assert rank.weight_bytes + rank.scale_bytes == held
    assert shard0.scale_bytes > 0


def test_the_tiny_v3_cpu_sample_fits_its_pods(checkpoints):
    report = fit(json.loads(Path(checkpoints["deepseek_v3"], "config.json").read_text()),
                 yaml.safe_load(CPU_SAMPLE.read_text()))
    assert [r.verdict for r in report.ranks] == ["fits", "fits"]
    assert report.ranks[0].device.total_bytes == 4 << 30 and report.ranks[0].kv_tokens > 1000


def test_a_sharded_share_is_built_without_allocating_its_experts():
    """Sizing a DeepSeek-V3 shard builds it on meta; the expert slices once were real host tensors (~330 GB)."""
    import torch

    from afd.models.loader import build_share

    model, _, _ = build_share(json.loads(V3_CONFIG.read_text()), "ffn", False, torch.bfloat16, "meta", (0, 8))
    assert {p.device.type for p in model.parameters()} == {"meta"}


@pytest.mark.parametrize("cr, message", [
    ({"spec": {"attention": {"resources": {"limits": {"nvidia.com/gpu": 1}}}, "ffn": {}}}, "which GPU?"),
    ({"spec": {"attention": {}, "ffn": {}}}, "no GPU and no memory limit"),
    ({"spec": {"attention": {"resources": {"limits": {"memory": "lots"}}}}}, "memory quantity 'lots'"),
])
def test_unreadable_crs_name_the_field(cr, message):
    from afd.planner.fit import FitError

    with pytest.raises(FitError, match=re.escape(message)):
        fit(json.loads(V3_CONFIG.read_text()), cr)
