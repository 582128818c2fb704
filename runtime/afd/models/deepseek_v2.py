"""DeepSeek-V2: multi-head latent attention, shared + routed experts, first layers dense."""

from __future__ import annotations

import torch
from torch import nn

from afd.models.attention import AttentionBatch, cached_attention
from afd.models.base import DecoderLayer, MoECausalLM
from afd.models.layers import GatedMLP, MoE, RMSNorm, Rotary, Routing, apply_rope_pairs, yarn_mscale
from afd.models.spec import KVLayout, ModelSpec, rope_parameters


class MultiHeadLatentAttention(nn.Module):
    """MLA: queries (optionally low-rank), one compressed KV latent plus a shared rotary key.

    The cache holds one [normed latent ‖ rotary key] row per token (KVLayout with
    `values_in_keys`), ~9x less than expanded per-head keys and values at DeepSeek-V2-Lite
    shapes. Attention runs in the latent space: the key up-projection is absorbed into
    the query (q·W_uk c = (W_ukᵀq)·c) and the value up-projection applied to the
    attention-weighted latent (Σ p W_uv c = W_uv Σ p c), for prefill and decode alike.
    """

    def __init__(self, config: dict):
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        bias = bool(config.get("attention_bias", False))
        self.heads = heads
        self.q_lora_rank = config.get("q_lora_rank")
        self.kv_lora_rank = config["kv_lora_rank"]
        self.nope_dim, self.rope_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
        self.v_dim = config["v_head_dim"]
        qk_dim = self.nope_dim + self.rope_dim
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = nn.Linear(self.q_lora_rank, heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)
        self.rope = rope_parameters(config)
        self.scale = qk_dim**-0.5
        if self.rope["rope_type"] != "default" and self.rope.get("mscale_all_dim"):
            self.scale *= yarn_mscale(self.rope["factor"], self.rope["mscale_all_dim"]) ** 2
        self.rotary = Rotary(self.rope, self.rope_dim)
        self.kv_layout = KVLayout(1, self.kv_lora_rank + self.rope_dim, self.kv_lora_rank, values_in_keys=True)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj per head: key [heads, nope, latent] and value [heads, v, latent]."""
        weight = self.kv_b_proj.weight.view(self.heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return weight[:, : self.nope_dim], weight[:, self.nope_dim :]

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(query [T, heads, latent + rope] with the key up-projection absorbed, the token's cache row
        [T, 1, latent + rope], None: the values are the latent part of the keys)."""
        tokens = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(tokens, self.heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cos, sin = self.rotary(positions)
        q_pe = apply_rope_pairs(q_pe, cos, sin)  # [T, heads, rope]
        k_pe = apply_rope_pairs(k_pe.view(tokens, 1, self.rope_dim), cos, sin)  # [T, 1, rope]
        key_up, _ = self.up_projections()
        q_latent = torch.bmm(q_nope.transpose(0, 1), key_up).transpose(0, 1)  # [T, heads, latent]
        query = torch.cat((q_latent, q_pe), dim=-1)  # [T, heads, latent + rope]
        key = torch.cat((self.kv_a_layernorm(latent).unsqueeze(1), k_pe), dim=-1)  # [T, 1, latent + rope]
        return query, key, None

    def finish(self, attended: torch.Tensor) -> torch.Tensor:
        """The value up-projection of the attention-weighted latent [T, heads, latent], then o_proj."""
        _, value_up = self.up_projections()
        out = torch.bmm(attended.transpose(0, 1), value_up.transpose(1, 2)).transpose(0, 1)  # [T, heads, v]
        return self.o_proj(out.reshape(attended.shape[0], -1))

    def forward(self, x: torch.Tensor, batch: AttentionBatch, cache_k, cache_v) -> torch.Tensor:
        query, key, _ = self.project(x, batch.positions)
        return self.finish(cached_attention(query, key, None, cache_k, cache_v, batch, self.scale))

def build(config: dict, spec: ModelSpec) -> MoECausalLM:
    hidden = spec.hidden_size
    routing = Routing(
        top_k=config["num_experts_per_tok"] if spec.num_experts else 1,
        num_experts=spec.num_experts,
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        topk_method=config.get("topk_method") or "greedy",
        num_groups=config.get("n_group") or 1,
        topk_groups=config.get("topk_group") or 1,
        scale_when_normalized=False,
    )
    expert_width = config.get("moe_intermediate_size", 0)
    shared_width = expert_width * (config.get("n_shared_experts") or 0)

    def mlp(is_moe: bool) -> nn.Module:
        if is_moe:
            return MoE(hidden, routing, expert_width, shared_width, fp32_logits=True)
        return GatedMLP(hidden, config["intermediate_size"], bias=bool(config.get("mlp_bias", False)))

    layers = [
        DecoderLayer(MultiHeadLatentAttention(config), mlp(is_moe), hidden, spec.rms_norm_eps)
        for is_moe in spec.moe_layers
    ]
    return MoECausalLM(spec, layers)
