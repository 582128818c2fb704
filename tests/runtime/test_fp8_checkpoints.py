"""FP8 block-quantized checkpoints (DeepSeek-V3, Qwen3-MoE and GLM-4.x, the published DeepSeek-V3 format): on CPU the weights are
dequantized at load, so our model equals transformers run on the dequantized weights."""

import re

import pytest

from tests.conftest import max_relative_error
from tests.runtime.test_models import monolithic_generate


@pytest.mark.parametrize("name", ["qwen3_moe_fp8", "deepseek_v3_fp8", "glm4_moe_fp8"])
def test_fp8_monolith_equals_transformers_on_the_dequantized_weights(name, checkpoints, hf_reference):
    tokens, logits = hf_reference(name)
    result = monolithic_generate(checkpoints[name])
    assert result.tokens == tokens
    assert max_relative_error(result.last_logits, logits) < 1e-4


def test_kept_fp8_layout_computes_what_the_dequantized_model_does(checkpoints):
    """What a GPU rank holds (keep_fp8): FP8 Linear layers and FP8 expert stacks with block scales, kv_b_proj
    dequantized; on CPU they compute exactly what the model dequantized at load computes, in fewer bytes."""
    import torch

    from afd.kernels.fp8_blocks import FP8_DTYPE
    from afd.models.fp8 import Fp8Linear
    from afd.models.layers import Experts
    from afd.models.loader import load_model

    path = str(checkpoints["deepseek_v3_fp8"])
    kept, plain = load_model(path, keep_fp8=True), load_model(path)
    attention = kept.model.layers[1].self_attn
    assert isinstance(attention.q_a_proj, Fp8Linear) and isinstance(attention.o_proj, Fp8Linear)
    assert type(attention.kv_b_proj) is torch.nn.Linear and attention.kv_b_proj.weight.dtype == torch.float32
    assert isinstance(kept.model.layers[0].mlp.down_proj, Fp8Linear)  # the dense first layer
    experts = kept.model.layers[1].mlp.experts
    assert isinstance(experts, Experts) and experts.gate_up.dtype == FP8_DTYPE and experts.down.dtype == FP8_DTYPE
    # hidden 160, width 128: gate_up [16, 256, 160] in blocks [2, 2]; down [16, 160, 128] in blocks [2, 1]
    assert experts.gate_up_scale.shape == (16, 2, 2) and experts.down_scale.shape == (16, 2, 1)
    assert plain.model.layers[1].mlp.experts.gate_up_scale is None
    torch.testing.assert_close(experts.dense_weights(torch.float32)[0], plain.model.layers[1].mlp.experts.gate_up,
                               rtol=0, atol=0)
    assert kept.resident_bytes < plain.resident_bytes * 0.45
    torch.manual_seed(0)
    hidden = torch.randn(9, 160)
    for index in (0, 1, 2):
        torch.testing.assert_close(kept.model.layers[index].ffn_half(hidden),
                                   plain.model.layers[index].ffn_half(hidden), rtol=1e-6, atol=1e-6)


def test_kept_fp8_attention_with_biases_computes_what_the_dequantized_model_does(checkpoints):
    """GLM-4.x's q/k/v projections carry biases: kept FP8 (what a GPU rank holds) they are Fp8Linear layers with
    their bias, and the attention's query, key and value equal those of the model dequantized at load."""
    import torch

    from afd.models.fp8 import Fp8Linear
    from afd.models.loader import load_model

    path = str(checkpoints["glm4_moe_fp8"])
    kept, plain = load_model(path, keep_fp8=True), load_model(path)
    attention = kept.model.layers[1].self_attn
    assert isinstance(attention.q_proj, Fp8Linear) and attention.q_proj.bias is not None
    assert isinstance(attention.o_proj, Fp8Linear) and attention.o_proj.bias is None
    torch.manual_seed(0)
    hidden, positions = torch.randn(5, 64), torch.arange(5)
    for ours, reference in zip(attention.project(hidden, positions),
                               plain.model.layers[1].self_attn.project(hidden, positions)):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_fp8_expert_shards_read_their_experts_and_scales_only(gate_on_attention, checkpoints):
    """A shard of G reads 1/G of the routed experts' FP8 weights and their scales, kept FP8 or dequantized."""
    import re

    from afd.models.checkpoint import Checkpoint
    from afd.models.loader import load_model
    from afd.config.topology import shard_range

    path = str(checkpoints["deepseek_v3_fp8"])
    routed = {k for k in Checkpoint(path).keys() if re.search(r"^model\.layers\.[12]\.mlp\.experts\.", k)}
    for keep in (False, True):
        for shard in range(2):
            read = set(load_model(path, "ffn", gate_on_attention, shard=(shard, 2), keep_fp8=keep).loaded_keys)
            start, stop = shard_range(16, 2, shard)
            mine = {k for k in routed if start <= int(k.split(".")[5]) < stop}
            assert read & routed == mine
            assert any(k.endswith("weight_scale_inv") for k in mine)


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "awq", "bits": 4}, "quantization_config.quant_method='awq' is not supported"),
    ({"quant_method": "gptq"}, "quant_method='gptq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme='static' (static activation scales) is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size (per-tensor FP8)"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size=[64, 64] is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt='e5m2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "kv_cache_scheme": {"num_bits": 8}},
     "settings this runtime does not honour: kv_cache_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["model.layers.1.self_attn"]},
     "is float8 although quantization_config.modules_to_not_convert lists 'model.layers.1.self_attn'"),
    (None, "is float8 but config.json has no quantization_config"),
])
def test_unsupported_quantization_is_refused_by_name(quantization, message, checkpoints, tmp_path):
    import json
    import shutil

    from afd.models.loader import load_model
    from afd.models.spec import UnsupportedModelError

    folder = tmp_path / "model"
    shutil.copytree(checkpoints["deepseek_v3_fp8"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    if quantization is None:
        del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        load_model(str(folder))


def test_a_float8_weight_without_its_scale_is_refused(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from afd.models.loader import load_model
    from afd.models.spec import UnsupportedModelError

    folder = tmp_path / "model"
    shutil.copytree(checkpoints["qwen3_moe_fp8"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(folder / "model.safetensors"))
    message = ("model.layers.1.self_attn.o_proj.weight is float8 without "
               "model.layers.1.self_attn.o_proj.weight_scale_inv")
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        load_model(str(folder))


def test_published_quantization_configs_are_written(checkpoints):
    import json

    qwen = json.loads((checkpoints["qwen3_moe_fp8"] / "config.json").read_text())["quantization_config"]
    v3 = json.loads((checkpoints["deepseek_v3_fp8"] / "config.json").read_text())["quantization_config"]
    assert v3 == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    not_converted = qwen["modules_to_not_convert"]
    assert not_converted[0] == "lm_head" and "model.layers.1.mlp.gate" in not_converted


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_fp8", "glm4_moe_fp8"])
def test_resident_bytes_of_the_roles_add_up_and_are_exported(name, checkpoints):
    """Attention and FFN (gate on the FFN) partition the monolith's bytes; the exported gauge is the loader's count."""
    from prometheus_client import CollectorRegistry

    from afd.config import AFDConfig
    from afd.metrics.wiring import export_resident_bytes
    from afd.models.loader import load_model

    path = str(checkpoints[name])
    whole = load_model(path).resident_bytes
    parts = [load_model(path, role).resident_bytes for role in ("attention", "ffn")]
    assert sum(parts) == whole
    registry = CollectorRegistry()
    export_resident_bytes(registry, AFDConfig(role="ffn", rank=0, model=path).group, parts[1])
    assert registry.get_sample_value("afd_weights_resident_bytes", {"role": "ffn", "rank": "0"}) == parts[1]


def test_fp8_experts_stacked_in_one_tensor_are_refused(checkpoints, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from afd.kernels.fp8_blocks import quantize_block_fp8
    from afd.models.loader import load_model
    from afd.models.spec import UnsupportedModelError

    folder = tmp_path / "model"
    shutil.copytree(checkpoints["qwen3_moe_fp8"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    stacked, scale = quantize_block_fp8(torch.randn(8, 64, 64))
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = stacked
    tensors["model.layers.1.mlp.experts.gate_up_proj_scale_inv"] = scale
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="model.layers.1.mlp.experts.gate_up_proj: FP8 experts stacked"):
        load_model(str(folder))


def test_fp8_expert_shards_split_one_shared_expert_on_block_edges_and_add_up_to_the_full_layer(tmp_path):
    """DeepSeek-V3 has one shared expert: over 2 shards each keeps half its columns as FP8 `Fp8Linear`s (the halves
    on 128-column block edges, scales sliced with them); the shards' FFN outputs add up to the unsharded FP8 layer's.
    (On the GPU each half runs through the fused kernels as the monolith's folded expert does:
    tests/runtime/test_shared_stack.py.)"""
    import torch

    from afd.models.fp8 import Fp8Linear
    from afd.models.loader import load_model
    from tests.gpu.v3_checkpoint import write_v3_shaped

    small = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, n_routed_experts=8,
                 num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128, n_group=4,
                 topk_group=2, num_experts_per_tok=2)
    _, path = write_v3_shaped(None, tmp_path / "fp8", device="cpu", overrides=small)
    full = load_model(str(path), keep_fp8=True)
    shards = [load_model(str(path), "ffn", False, shard=(shard, 2), keep_fp8=True) for shard in range(2)]
    for shard in shards:
        shared = shard.model.layers[1].mlp.shared_experts
        assert isinstance(shared.gate_proj, Fp8Linear) and shared.gate_proj.out_features == 128
        assert isinstance(shared.down_proj, Fp8Linear) and shared.down_proj.in_features == 128
    torch.manual_seed(0)
    hidden = torch.randn(9, 256)
    for index in (0, 1):  # the dense first layer (whole on shard 0), the MoE layer
        parts = sum(shard.model.layers[index].ffn_half(hidden).float() for shard in shards)
        torch.testing.assert_close(parts, full.model.layers[index].ffn_half(hidden).float(), rtol=1e-5, atol=1e-6)
