"""bench/kernels/skinny_tune.py without a GPU: the decode GEMMs it tunes are the sample models' real projections, and on
a machine without CUDA it says so and writes nothing."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.kernels import skinny_tune  # noqa: E402


def test_the_tuned_gemms_are_the_decode_projections_of_both_sample_models():
    v2, qwen = skinny_tune.V2_LITE, skinny_tune.QWEN3_30B_A3B
    found = {(g.model, g.name): (g.n, g.k, g.out) for name, config in skinny_tune.SHAPES.items()
             for g in skinny_tune.decode_gemms(name, config)}
    heads, hidden = v2["num_attention_heads"], v2["hidden_size"]
    q = heads * (v2["qk_nope_head_dim"] + v2["qk_rope_head_dim"])  # q_lora_rank None: a plain q_proj
    assert found[("deepseek-v2-lite", "in_weight")] == (q + v2["kv_lora_rank"] + v2["qk_rope_head_dim"], hidden, "input")
    assert found[("deepseek-v2-lite", "o_proj")] == (hidden, heads * v2["v_head_dim"], "input")
    assert found[("deepseek-v2-lite", "router parts")] == (3 * v2["n_routed_experts"], hidden, "float32")
    d = qwen["head_dim"]
    qkv = (qwen["num_attention_heads"] + 2 * qwen["num_key_value_heads"]) * d
    assert found[("qwen3-30b-a3b", "qkv_weight")] == (qkv, qwen["hidden_size"], "input")
    assert found[("qwen3-30b-a3b", "o_proj")] == (qwen["hidden_size"], qwen["num_attention_heads"] * d, "input")
    assert found[("qwen3-30b-a3b", "router")] == (qwen["num_experts"], qwen["hidden_size"], "float32")
    assert len(found) == 6


def test_candidates_fill_the_gpu_without_flooding_it_or_spilling():
    for n in (128, 192, 2048, 5120):
        for m in (1, 3, 16):
            tried = skinny_tune.candidates(n, 132, m)
            assert {s["DOT"] for s in tried} == {False, True}
            for setting in tried:
                programs = -(-n // setting["BLOCK_N"]) * setting["SPLIT_K"]
                assert setting["SPLIT_K"] == 1 or 66 <= programs <= 8 * 132
                assert skinny_tune.fits(setting, m)
    assert not skinny_tune.fits({"DOT": False, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4}, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message; a GPU tunes instead")
def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["skinny_tune.py"])
    with pytest.raises(SystemExit, match="bench/kernels/skinny_tune.py needs a CUDA GPU"):
        skinny_tune.main()
    assert list(tmp_path.iterdir()) == []


def test_the_written_table_holds_the_wins_and_reads_back(tmp_path, monkeypatch, capsys):
    """main()'s bookkeeping with the GPU parts stood in for: a >= 5 % win is an entry, anything less "cublas", and
    the file is one that `skinny_gemm.read_table` takes."""
    pytest.importorskip("triton")
    from afd.kernels import skinny_gemm

    fast = {"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 4, "DOT": False, "num_warps": 4, "num_stages": 3}

    def tune_one(gemm, m, weights, sms):
        faster = 1.5 if (gemm.name, m) == ("o_proj", 1) else 1.02  # only o_proj at M 1 wins enough
        return {"setting": fast, "triton_us": 10.0, "torch_us": 10.0 * faster, "tried": 3, "rejected": 0}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "Test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: type("P", (), {"multi_processor_count": 132}))
    monkeypatch.setattr(skinny_tune, "ceilings", lambda: {"copy_bytes_per_s": 4e12})
    monkeypatch.setattr(skinny_tune, "weight_copies", lambda gemm: [])
    monkeypatch.setattr(skinny_tune, "tune_one", tune_one)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["skinny_tune.py", "--shapes", "qwen3-30b-a3b", "--rows", "1,2"])
    assert skinny_tune.main() == 0
    table = skinny_gemm.read_table(tmp_path / "skinny_Test_GPU.json")
    qwen = skinny_tune.QWEN3_30B_A3B
    o_proj = (qwen["hidden_size"], qwen["num_attention_heads"] * qwen["head_dim"])
    assert table[(*o_proj, 1, "input")] == fast
    assert len(table) == 6 and sum(setting is not None for setting in table.values()) == 1
    printed = capsys.readouterr().out
    assert "floor_us" in printed and "triton {" in printed
