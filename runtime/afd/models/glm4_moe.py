"""GLM-4.5, 4.5-Air, 4.6 and 4.7 (`glm4_moe`): grouped-query attention with DeepSeek-V3's MoE.

Attention is GQA whose q, k and v projections may carry a bias (`attention_bias`; o_proj never does), whose
query and key heads may be RMS-normed (`use_qk_norm`), and whose rotary embedding turns only the first
`partial_rotary_factor` of each head's dims (half-split layout; the rest pass through). The feed-forward is
DeepSeek-V3's: the first `first_k_dense_replace` layers dense, then routed experts chosen by the noaux_tc
router (`Routing.noaux_tc`: sigmoid scores, a per-expert correction bias, `topk_group` of `n_group` groups)
plus shared experts. The checkpoint's next-token-prediction (MTP) layer, `model.layers.{num_hidden_layers}`,
is not part of this model: the loader neither reads nor keeps it (as DeepSeek-V3's).
"""

from __future__ import annotations

import torch
from torch import nn

from afd.models import deepseek_v3
from afd.models.decoder import DecoderLayer, MoECausalLM
from afd.models.gqa import GQAttention
from afd.models.layers import GatedMLP, MoE, RMSNorm, Rotary, apply_rope_halves, fused_linear
from afd.models.spec import ModelSpec, rope_parameters

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # transformers' Glm4MoeConfig's, where config.json names none
GLM_ROUTED_SCALING = 1.0  # Glm4MoeConfig's default `routed_scaling_factor`, where config.json names none


def rotary_dims(config: dict, head_dim: int) -> int:
    """How many leading dims of each head the rotary embedding turns: `partial_rotary_factor` of the head, read
    from the rope settings or the top level of config.json (where the published GLM configs keep it)."""
    rope = rope_parameters(config)
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    return int(head_dim * float(factor))


class PartialRotaryAttention(GQAttention):
    """GQA with optional q/k biases and per-head q/k RMS norms, rotary on the first `rope_dim` dims of a head."""

    def __init__(self, config: dict):
        super().__init__(config, o_bias=False)
        if config.get("use_qk_norm", False):
            eps = float(config.get("rms_norm_eps", 1e-5))
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        else:
            self.q_norm = self.k_norm = None
        self.rope_dim = rotary_dims(config, self.head_dim)
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"partial rotary over {self.rope_dim} of {self.head_dim} head dims: must be even, > 0")
        self.rotary = Rotary(rope_parameters(config), self.rope_dim, int(config.get("max_position_embeddings") or 0))

    def _project(self, x: torch.Tensor, positions: torch.Tensor, store) -> tuple[tuple, bool]:
        """Normed (if `use_qk_norm`), partly rotated query [T, heads, d] and key [T, kv_heads, d]; value
        [T, kv_heads, d]; never in the cache yet (`store` unused)."""
        tokens = x.shape[0]
        q, k, v = fused_linear(x, self.qkv_weight, self.q_proj, self.k_proj, self.v_proj)
        q = q.reshape(tokens, self.heads, self.head_dim)
        k = k.reshape(tokens, self.kv_heads, self.head_dim)
        v = v.reshape(tokens, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary(positions)
        return (self._rotate(q, cos, sin), self._rotate(k, cos, sin), v), False

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary (halves layout) on the first `rope_dim` dims of each head; the others as they are."""
        if self.rope_dim == self.head_dim:
            return apply_rope_halves(x, cos, sin)
        turned, passed = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope_halves(turned, cos, sin), passed), dim=-1)


def build(config: dict, spec: ModelSpec) -> MoECausalLM:
    hidden = spec.hidden_size
    router = deepseek_v3.routing(config, spec, default_scaling=GLM_ROUTED_SCALING)
    expert_width = config["moe_intermediate_size"]
    shared_width = expert_width * int(config.get("n_shared_experts") or 0)

    def mlp(is_moe: bool) -> nn.Module:
        if is_moe:
            return MoE(hidden, router, expert_width, shared_width, fp32_logits=True)
        return GatedMLP(hidden, config["intermediate_size"])

    layers = [
        DecoderLayer(PartialRotaryAttention(config), mlp(is_moe), hidden, spec.rms_norm_eps)
        for is_moe in spec.moe_layers
    ]
    return MoECausalLM(spec, layers)
