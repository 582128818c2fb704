"""DeepSeek-V3 (V3, R1, V3.1) and Kimi-K2: DeepSeek-V2's model with the noaux_tc router.

Everything else is V2's: multi-head latent attention with or without a query LoRA, the latent
KV cache and absorbed decode, YaRN with its attention scale, shared experts and the first
`first_k_dense_replace` layers dense. The router scores experts with a sigmoid, chooses them by
score plus a learned per-expert bias (`e_score_correction_bias`) within the best `topk_group` of
`n_group` expert groups, and weights them by their unbiased scores (`Routing.noaux_tc`).
The checkpoint's next-token-prediction (MTP) layers, numbered from `num_hidden_layers` on, are
not part of this model: the loader neither reads nor keeps them.
"""

from __future__ import annotations

from afd.models import deepseek_v2
from afd.models.decoder import MoECausalLM
from afd.models.layers import Routing
from afd.models.spec import ModelSpec

ARCHES = ("deepseek_v3", "kimi_k2")


def routing(config: dict, spec: ModelSpec, default_scaling: float = 2.5) -> Routing:
    """The noaux_tc router of a DeepSeek-V3 config (its defaults are transformers' DeepseekV3Config's; a family that
    shares the router, GLM-4.x, gives its own default `routed_scaling_factor`)."""
    return Routing(
        top_k=int(config.get("num_experts_per_tok") or 8),
        num_experts=spec.num_experts,
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        scaling_factor=float(config.get("routed_scaling_factor", default_scaling)),
        topk_method="noaux_tc",
        num_groups=int(config.get("n_group") or 1),
        topk_groups=int(config.get("topk_group") or 1),
        scale_when_normalized=True,
    )


def build(config: dict, spec: ModelSpec) -> MoECausalLM:
    return deepseek_v2.build(config, spec, routing(config, spec))
