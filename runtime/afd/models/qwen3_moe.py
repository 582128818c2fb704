"""Qwen3-MoE: grouped-query attention with per-head q/k norms; routed experts, no shared ones."""

from __future__ import annotations

import torch
from torch import nn

from afd.models.decoder import DecoderLayer, MoECausalLM
from afd.models.gqa import GQAttention
from afd.models.kv_dtype import fused_store
from afd.models.layers import GatedMLP, MoE, RMSNorm, Rotary, Routing, apply_rope_halves, fused_glue, fused_linear
from afd.models.spec import ModelSpec, rope_parameters


class GroupedQueryAttention(GQAttention):
    """GQA with RMS-normed query and key heads, rotary in the half-split layout."""

    def __init__(self, config: dict):
        super().__init__(config, o_bias=True)
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)
        self.rope = rope_parameters(config)
        self.rope_dim = int(self.head_dim * self.rope.get("partial_rotary_factor", 1.0))
        if self.rope_dim != self.head_dim:
            raise ValueError("partial_rotary_factor < 1 is not supported for qwen3_moe")
        self.rotary = Rotary(self.rope, self.head_dim, int(config.get("max_position_embeddings") or 0))

    def _project(self, x: torch.Tensor, positions: torch.Tensor, store) -> tuple[tuple, bool]:
        """`project`'s inputs, and whether the key and value are in the cache already: with `store` = (cache_k,
        cache_v, write index), the fused glue writes them there in the same launch (then `attend` need not)."""
        tokens = x.shape[0]
        table = self.rotary.table(x.device) if fused_glue(x) else None
        if table is not None and self.q_norm.weight.dtype == self.k_norm.weight.dtype == x.dtype:
            # local import: Triton is optional (CPU installs have none): loaded where its kernel runs
            from afd.kernels.norm_rope import qk_rows_  # norms, rotary and cache writes: one launch, not six

            q, k, v = fused_linear(x, self.qkv_weight, self.q_proj, self.k_proj, self.v_proj)
            q = q.view(tokens, self.heads, self.head_dim)
            k, v = k.view(tokens, self.kv_heads, self.head_dim), v.view(tokens, self.kv_heads, self.head_dim)
            cache_k, cache_v, index = (store if store is not None and fused_store(store[0].dtype, k.dtype)
                                      else (None, None, None))
            qk_rows_(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.k_norm.eps, positions,
                     *table, cache_k, cache_v, index)
            return (q, k, v), cache_k is not None
        q = self.q_norm(self.q_proj(x).view(tokens, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(tokens, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(tokens, self.kv_heads, self.head_dim)
        table = self.rotary.table(x.device) if fused_glue(x) else None
        if table is not None:  # in place on the norms' fresh outputs: one launch each instead of ~12
            # local import: Triton is optional (CPU installs have none): loaded where its kernel runs
            from afd.kernels.norm_rope import rope_

            return (rope_(q, positions, *table, interleaved=False), rope_(k, positions, *table, interleaved=False), v), False
        cos, sin = self.rotary(positions)
        return (apply_rope_halves(q, cos, sin), apply_rope_halves(k, cos, sin), v), False


def build(config: dict, spec: ModelSpec) -> MoECausalLM:
    hidden = spec.hidden_size
    routing = Routing(
        top_k=config["num_experts_per_tok"] if spec.num_experts else 1,
        num_experts=spec.num_experts,
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
    )

    def mlp(is_moe: bool) -> nn.Module:
        if is_moe:
            return MoE(hidden, routing, config["moe_intermediate_size"], 0, fp32_logits=False)
        return GatedMLP(hidden, config["intermediate_size"])

    layers = [
        DecoderLayer(GroupedQueryAttention(config), mlp(is_moe), hidden, spec.rms_norm_eps)
        for is_moe in spec.moe_layers
    ]
    return MoECausalLM(spec, layers)
