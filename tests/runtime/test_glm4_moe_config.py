"""A published GLM-4.x config.json (GLM-4.5-Air's shape: partial rotary and rope_theta at its top level, no q/k
norms, q/k/v biases) builds the model it describes; expert groups that cannot route are refused by name."""

import pytest
import torch

from afd.models.loader import build_share
from afd.models.spec import UnsupportedModelError, parse_spec

GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 4096,
    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 46,
    "first_k_dense_replace": 1, "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "moe_intermediate_size": 1408, "intermediate_size": 10944, "partial_rotary_factor": 0.5, "rope_theta": 1000000,
    "use_qk_norm": False, "attention_bias": True, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "vocab_size": 151552, "num_nextn_predict_layers": 1, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "hidden_act": "silu", "tie_word_embeddings": False, "eos_token_id": [151329, 151336],
}


def test_a_published_glm_config_builds_its_model():
    spec = parse_spec(GLM_45_AIR)
    assert spec.moe_layers == (False,) + (True,) * 45 and spec.num_experts == 128
    assert (spec.kv_layout.heads, spec.kv_layout.key_dim, spec.kv_layout.value_dim) == (8, 128, 128)
    model, _, _ = build_share(GLM_45_AIR, "monolithic", False, torch.bfloat16, "meta")
    attention = model.layers[0].self_attn
    assert attention.rope_dim == 64 and attention.rotary.rope["rope_theta"] == 1000000
    assert attention.q_norm is None and attention.q_proj.bias is not None and attention.o_proj.bias is None
    assert len(model.layers) == 46  # the MTP layer (model.layers.46) is not part of it
    moe = model.layers[1].mlp
    assert moe.routing.topk_method == "noaux_tc" and moe.routing.scaling_factor == 1.0
    assert moe.e_score_correction_bias.shape == (128,) and moe.shared_experts.gate_proj.weight.shape == (1408, 4096)


@pytest.mark.parametrize("groups, topk_groups, message", [
    (3, 1, "n_group=3, topk_group=1 do not divide n_routed_experts=128"),
    (64, 2, "topk_group=2 groups of 2 experts hold fewer than num_experts_per_tok=8"),
])
def test_glm_expert_groups_that_cannot_route_are_refused(groups, topk_groups, message):
    with pytest.raises(UnsupportedModelError, match=message):
        parse_spec({**GLM_45_AIR, "n_group": groups, "topk_group": topk_groups})
