"""bench/step/step_floor.py's floor: what a decode step must read and compute, from the model's own tensors."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.step.step_floor import (ExpertLayer, ModelTraffic, fitting_kv_cache, model_traffic, parse_pdl,  # noqa: E402
                        pdl_launches, step_floor)

from afd.models.loader import load_model  # noqa: E402


def test_the_floor_reads_dense_weights_once_hit_experts_and_the_kv_of_every_sequence():
    traffic = ModelTraffic(dense_bytes=1000, dense_params=400, experts=(ExpertLayer(100, 50, 2),) * 2,
                           embed_row_bytes=8, kv_bytes_per_token=4, attention_flops_per_cached_token=10)
    floor = step_floor(traffic, batch=3, context=9, experts_hit=[2, 5], copy_bytes_per_s=1e3, flops_per_s=1e6)
    assert floor.bytes == 1000 + 3 * 8 + 3 * 10 * 4 + (2 + 5) * 100
    assert floor.flops == 2 * 3 * 400 + 3 * 10 * 10 + 2 * (2 * 3 * 2 * 50)
    assert floor.ms == pytest.approx(max(floor.bytes, floor.flops / 1e3))
    two = step_floor(traffic, batch=3, context=9, experts_hit=[2, 5], copy_bytes_per_s=1e3, flops_per_s=1e6,
                     micro_batches=2)
    assert two.bytes == floor.bytes  # no layer_dense_bytes given: nothing is read twice
    split = ModelTraffic(1000, 400, (), 8, 4, 10, layer_dense_bytes=900)
    once, twice = (step_floor(split, 4, 9, [], 1e3, 1e6, micro_batches=m) for m in (1, 2))
    assert twice.bytes - once.bytes == 900 and twice.flops == once.flops  # the layers' weights read again, no more work
    with pytest.raises(ValueError, match="2 MoE layers"):
        step_floor(traffic, 1, 0, [1], 1e3, 1e6)
    with pytest.raises(ValueError, match="batch 0"):
        step_floor(traffic, 0, 0, [1, 1], 1e3, 1e6)


@pytest.mark.parametrize("arch", ["deepseek_v2", "qwen3_moe"])
def test_model_traffic_counts_every_weight_once(arch, checkpoints):
    model = load_model(str(checkpoints[arch]), "monolithic").model
    traffic = model_traffic(model)
    moe = [layer.mlp for layer in model.layers if layer.is_moe]
    routed = sum(m.experts.gate_up.numel() + m.experts.down.numel() for m in moe)
    shared = sum(p.numel() for m in moe if m.shared_experts is not None for p in m.shared_experts.parameters())
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() for p in model.parameters())
    element = embed.element_size()
    assert traffic.dense_bytes == (total - routed - embed.numel()) * element
    in_layers = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("model.layers."))
    assert traffic.layer_dense_bytes == in_layers - routed * element  # all but the embedding, final norm and LM head
    assert 0 < traffic.layer_dense_bytes < traffic.dense_bytes
    assert sum(e.expert_bytes * m.experts.num_experts for e, m in zip(traffic.experts, moe)) == routed * element
    assert [e.top_k for e in traffic.experts] == [m.routing.top_k for m in moe]
    assert shared == 0 or traffic.dense_params > shared
    assert traffic.kv_bytes_per_token == sum(l.elements_per_token for l in model.kv_layouts()) * element


def test_pdl_settings_are_off_on_or_both_in_order_and_nothing_else():
    assert parse_pdl("off") == (False,)
    assert parse_pdl("on,off") == (True, False)
    assert parse_pdl("off, on,off") == (False, True)
    for bad in ("", "yes", "off,maybe"):
        with pytest.raises(SystemExit, match="--pdl"):
            parse_pdl(bad)


def test_pdl_launches_sets_the_variable_inside_and_restores_it(monkeypatch):
    from afd.config import process_setting

    monkeypatch.setenv("AFD_PDL", "false")
    with pdl_launches(True):
        assert process_setting("AFD_PDL") is True
    assert process_setting("AFD_PDL") is False
    monkeypatch.delenv("AFD_PDL")
    with pdl_launches(False):
        assert process_setting("AFD_PDL") is False
    assert "AFD_PDL" not in os.environ


def test_a_batch_whose_kv_cache_does_not_fit_is_left_out_not_the_whole_shape(capsys):
    """Qwen3-30B-A3B's batch 256 at context 2,048 ran out of an 80 GB GPU and took the shape's other rows with it."""
    def make(model, batch, context):
        if batch * context > 64 * 2048:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return f"kv for {batch} × {context}"

    assert fitting_kv_cache(None, [256, 1, 64], [128, 2048], make) == ("kv for 64 × 2048", [1, 64])
    assert "batch 256 × context 2,048: its KV cache does not fit" in capsys.readouterr().out
    with pytest.raises(torch.OutOfMemoryError):
        fitting_kv_cache(None, [512], [2048], make)
