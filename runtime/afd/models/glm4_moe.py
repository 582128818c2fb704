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

from afd.models.decoder import DecoderLayer, MoECausalLM
from afd.models.layers import (GatedMLP, MoE, RMSNorm, Rotary, Routing, apply_linear, apply_rope_halves, fuse_linears,
                               fused_linear)
from afd.models.paged_attention import AttentionBatch, cached_attention
from afd.models.spec import KVLayout, ModelSpec, rope_parameters

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # transformers' Glm4MoeConfig's, where config.json names none


def rotary_dims(config: dict, head_dim: int) -> int:
    """How many leading dims of each head the rotary embedding turns: `partial_rotary_factor` of the head, read
    from the rope settings or the top level of config.json (where the published GLM configs keep it)."""
    rope = rope_parameters(config)
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    return int(head_dim * float(factor))


class PartialRotaryAttention(nn.Module):
    """GQA with optional q/k biases and per-head q/k RMS norms, rotary on the first `rope_dim` dims of a head."""

    def __init__(self, config: dict):
        super().__init__()
        hidden = config["hidden_size"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or hidden // self.heads
        self.out_head_dim = self.head_dim  # per head, of what `attend` returns
        bias = bool(config.get("attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        if config.get("use_qk_norm", False):
            eps = float(config.get("rms_norm_eps", 1e-5))
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        else:
            self.q_norm = self.k_norm = None
        self.rope_dim = rotary_dims(config, self.head_dim)
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"partial rotary over {self.rope_dim} of {self.head_dim} head dims: must be even, > 0")
        self.rotary = Rotary(rope_parameters(config), self.rope_dim, int(config.get("max_position_embeddings") or 0))
        self.kv_layout = KVLayout(self.kv_heads, self.head_dim, self.head_dim)
        self.scale = self.head_dim**-0.5
        self.qkv_weight: torch.Tensor | None = None  # fuse_projections(): q, k and v in one GEMM (bias-free only)

    def fuse_projections(self) -> None:
        """Once the weights are loaded: q_proj, k_proj and v_proj become views of one weight, one GEMM (not when
        they carry biases: `fuse_linears` leaves them as they are)."""
        self.qkv_weight = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed (if `use_qk_norm`), partly rotated query [T, heads, d] and key [T, kv_heads, d]; value
        [T, kv_heads, d]."""
        tokens = x.shape[0]
        q, k, v = fused_linear(x, self.qkv_weight, self.q_proj, self.k_proj, self.v_proj)
        q = q.reshape(tokens, self.heads, self.head_dim)
        k = k.reshape(tokens, self.kv_heads, self.head_dim)
        v = v.reshape(tokens, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary(positions)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary (halves layout) on the first `rope_dim` dims of each head; the others as they are."""
        if self.rope_dim == self.head_dim:
            return apply_rope_halves(x, cos, sin)
        turned, passed = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope_halves(turned, cos, sin), passed), dim=-1)

    def attend(self, inputs: tuple, batch: AttentionBatch, cache_k, cache_v, stored: bool = False) -> torch.Tensor:
        """Store the keys and values (unless `stored`), attend: [T, heads, head_dim]."""
        return cached_attention(*inputs, cache_k, cache_v, batch, self.scale, stored)

    def finish(self, attended: torch.Tensor) -> torch.Tensor:
        return apply_linear(self.o_proj, attended.reshape(attended.shape[0], -1))

    def forward(self, x: torch.Tensor, batch: AttentionBatch, cache_k, cache_v) -> torch.Tensor:
        return self.finish(self.attend(self.project(x, batch.positions), batch, cache_k, cache_v))


def routing(config: dict, spec: ModelSpec) -> Routing:
    """DeepSeek-V3's noaux_tc router with Glm4MoeConfig's defaults (scaling 1.0, normalized top-k)."""
    return Routing(
        top_k=int(config.get("num_experts_per_tok") or 8),
        num_experts=spec.num_experts,
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        topk_method="noaux_tc",
        num_groups=int(config.get("n_group") or 1),
        topk_groups=int(config.get("topk_group") or 1),
        scale_when_normalized=True,
    )


def build(config: dict, spec: ModelSpec) -> MoECausalLM:
    hidden = spec.hidden_size
    router = routing(config, spec)
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
