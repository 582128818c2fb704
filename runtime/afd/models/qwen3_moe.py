"""Qwen3-MoE: grouped-query attention with per-head q/k norms; routed experts, no shared ones."""

from __future__ import annotations

import torch
from torch import nn

from afd.models.paged_attention import AttentionBatch, cached_attention
from afd.models.decoder import DecoderLayer, MoECausalLM
from afd.models.layers import (GatedMLP, MoE, RMSNorm, Rotary, Routing, apply_linear, apply_rope_halves, fuse_linears,
                               fused_glue, fused_linear)
from afd.models.spec import KVLayout, ModelSpec, rope_parameters


class GroupedQueryAttention(nn.Module):
    """GQA with RMS-normed query and key heads, rotary in the half-split layout."""

    def __init__(self, config: dict):
        super().__init__()
        hidden = config["hidden_size"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or hidden // self.heads
        self.out_head_dim = self.head_dim  # per head, of what `attend` returns
        bias = bool(config.get("attention_bias", False))
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)
        self.rope = rope_parameters(config)
        self.rope_dim = int(self.head_dim * self.rope.get("partial_rotary_factor", 1.0))
        if self.rope_dim != self.head_dim:
            raise ValueError("partial_rotary_factor < 1 is not supported for qwen3_moe")
        self.rotary = Rotary(self.rope, self.head_dim, int(config.get("max_position_embeddings") or 0))
        self.kv_layout = KVLayout(self.kv_heads, self.head_dim, self.head_dim)
        self.scale = self.head_dim**-0.5
        self.qkv_weight: torch.Tensor | None = None  # fuse_projections(): q, k and v in one GEMM

    def fuse_projections(self) -> None:
        """Once the weights are loaded: q_proj, k_proj and v_proj become views of one weight, one GEMM."""
        self.qkv_weight = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated, normed query [T, heads, d] and key [T, kv_heads, d], and the value [T, kv_heads, d]."""
        return self._project(x, positions, None)[0]

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
            cache_k, cache_v, index = store if store is not None and store[0].dtype == k.dtype else (None, None, None)
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

    def attend(self, inputs: tuple, batch: AttentionBatch, cache_k, cache_v, stored: bool = False) -> torch.Tensor:
        """Store the keys and values (unless `stored`), attend: [T, heads, head_dim]."""
        return cached_attention(*inputs, cache_k, cache_v, batch, self.scale, stored)

    def finish(self, attended: torch.Tensor) -> torch.Tensor:
        return apply_linear(self.o_proj, attended.reshape(attended.shape[0], -1))

    def forward(self, x: torch.Tensor, batch: AttentionBatch, cache_k, cache_v) -> torch.Tensor:
        inputs, stored = self._project(x, batch.positions, (cache_k, cache_v, batch.write_index))
        return self.finish(self.attend(inputs, batch, cache_k, cache_v, stored))

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
