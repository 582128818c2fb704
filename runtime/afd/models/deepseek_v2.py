"""DeepSeek-V2: multi-head latent attention, shared + routed experts, first layers dense."""

from __future__ import annotations

import torch
from torch import nn

from afd.models.paged_attention import (AttentionBatch, cached_attention, one_token_attention, prompts_attention,
                                  single_tokens)
from afd.models.decoder import DecoderLayer, MoECausalLM
from afd.models.kv_dtype import fused_store, store_rows
from afd.models.layers import (GatedMLP, MoE, RMSNorm, Rotary, Routing, apply_linear, apply_rope_pairs, fuse_linears,
                               fused_glue, fused_linear, yarn_mscale)
from afd.models.spec import KVLayout, ModelSpec, rope_parameters


class MultiHeadLatentAttention(nn.Module):
    """MLA: queries (optionally low-rank), one compressed KV latent plus a shared rotary key.

    The cache holds one [normed latent ‖ rotary key] row per token (KVLayout with
    `values_in_keys`), ~9x less than expanded per-head keys and values at DeepSeek-V2-Lite
    shapes. Decode attends in the latent space: the key up-projection is absorbed into
    the query (q·W_uk c = (W_ukᵀq)·c) and the value up-projection applied to the
    attention-weighted latent (Σ p W_uv c = W_uv Σ p c). A prompt, whose queries are many,
    expands its cached latents into per-head keys and values instead (head dim 192 rather
    than 576, which flash kernels take).
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
        self.out_head_dim = self.v_dim  # per head, of what `attend` returns
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
        self.rotary = Rotary(self.rope, self.rope_dim, int(config.get("max_position_embeddings") or 0))
        self.kv_layout = KVLayout(1, self.kv_lora_rank + self.rope_dim, self.kv_lora_rank, values_in_keys=True)
        self.in_weight: torch.Tensor | None = None  # fuse_projections(): the query's and the latent's in one GEMM

    def _in_projections(self) -> tuple[nn.Module, nn.Module]:
        return (self.q_a_proj if self.q_lora_rank else self.q_proj), self.kv_a_proj_with_mqa

    def fuse_projections(self) -> None:
        """Once the weights are loaded: the two projections of the layer's input (q_proj or q_a_proj, and
        kv_a_proj_with_mqa) become views of one weight, one GEMM (not with FP8 weights: `fuse_linears`)."""
        self.in_weight = fuse_linears(*self._in_projections())

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj per head: key [heads, nope, latent] and value [heads, v, latent]."""
        weight = self.kv_b_proj.weight.view(self.heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return weight[:, : self.nope_dim], weight[:, self.nope_dim :]

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple:
        """(query [T, heads, nope + rope], the token's cache row [T, 1, latent + rope] = normed latent ‖
        rotary key, None: the values are the latent part of the keys, then any `_side_inputs`)."""
        return self._project(x, positions, None)[0]

    def _project(self, x: torch.Tensor, positions: torch.Tensor, store) -> tuple[tuple, bool]:
        """`project`'s inputs, and whether its rows are in the cache already: with `store` = (cache, write
        index), the fused glue writes them there in the same launch (then `attend` need not)."""
        tokens = x.shape[0]
        q, row = fused_linear(x, self.in_weight, *self._in_projections())  # [T, latent + rope] row: column views
        q_latent = self.q_a_layernorm(q) if self.q_lora_rank else None  # [T, q_lora_rank]
        q = self.q_b_proj(q_latent) if self.q_lora_rank else q
        side = self._side_inputs(x, q_latent, positions)
        table = self.rotary.table(x.device) if fused_glue(x) else None
        if table is not None:  # in place on the projections' fresh outputs: one launch instead of ~30
            # local import: Triton is optional (CPU installs have none): loaded where its kernel runs
            from afd.kernels.norm_rope import mla_rows_

            query = q.view(tokens, self.heads, -1)  # [T, heads, nope + rope]
            cache, index = store if store is not None and fused_store(store[0].dtype, row.dtype) else (None, None)
            mla_rows_(query, row, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, positions, *table, cache, index)
            return (query, row.view(tokens, 1, -1), None, *side), cache is not None
        q_nope, q_pe = q.view(tokens, self.heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = row.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cos, sin = self.rotary(positions)
        q_pe = apply_rope_pairs(q_pe, cos, sin)  # [T, heads, rope]
        k_pe = apply_rope_pairs(k_pe.view(tokens, 1, self.rope_dim), cos, sin)  # [T, 1, rope]
        query = torch.cat((q_nope, q_pe), dim=-1)  # [T, heads, nope + rope]
        key = torch.cat((self.kv_a_layernorm(latent).unsqueeze(1), k_pe), dim=-1)  # [T, 1, latent + rope]
        return (query, key, None, *side), False

    def _side_inputs(self, x: torch.Tensor, q_latent: torch.Tensor | None, positions: torch.Tensor) -> tuple:
        """More attention inputs of the layer's input `x` and query latent, after the three of `project`: none
        here; DeepSeek-V3.2's indexer adds its own (afd.models.deepseek_v32)."""
        return ()

    def attend(self, inputs: tuple, batch: AttentionBatch, cache_k, cache_v, stored: bool = False) -> torch.Tensor:
        """Store the cache rows (unless `stored`), attend: [T, heads, v]. One-token sequences attend in the latent
        space (key up-projection absorbed into the query, value up-projection after); a prompt's keys and values
        are expanded per head from its cached latents, as transformers computes them, for a flash kernel."""
        query, key = inputs[:2]
        if batch.max_new == 1:  # decode (what the decode graphs capture)
            if batch.block_table is not None and fused_glue(query):  # no concatenation: the kernel reads both parts
                # local import: Triton is optional (CPU installs have none): loaded where its kernel runs
                from afd.kernels.decode_attention import paged_latent_decode_attention

                if not stored:
                    store_rows(cache_k, batch.write_index, key)
                latent = paged_latent_decode_attention(
                    self._absorb_latent(query), cache_k, self.kv_lora_rank, batch.block_table, batch.seq_lens,
                    batch.block_size, self.scale, q_rope=query[..., self.nope_dim :])
            else:
                latent = cached_attention(self._absorb(query), key, None, cache_k, cache_v, batch, self.scale, stored)
            return self._values(latent)
        if not stored:
            store_rows(cache_k, batch.write_index, key)
        out = query.new_empty(query.shape[0], self.heads, self.v_dim)
        if batch.single_longest:
            tokens = single_tokens(batch)
            latent = one_token_attention(self._absorb(query[tokens]), cache_k, cache_v, batch, self.scale, True)
            out[tokens] = self._values(latent)
        if batch.prompts is not None:  # all prompts' latents expanded by one up-projection, one attention call
            layout = batch.prompts
            keys, values = self._expand(cache_k[layout.key_rows].to(query.dtype))
            out[layout.tokens] = prompts_attention(query[layout.tokens], keys, values, layout, self.scale)
        return out

    def _absorb(self, query: torch.Tensor) -> torch.Tensor:
        """[T, heads, nope + rope] → [T, heads, latent + rope]: q_nope · W_uk, the rotary part as is."""
        return torch.cat((self._absorb_latent(query), query[..., self.nope_dim :]), dim=-1)

    def _absorb_latent(self, query: torch.Tensor) -> torch.Tensor:
        """q_nope · W_uk: [T, heads, latent], a transposed view of the batched GEMM's [heads, T, latent]."""
        key_up, _ = self.up_projections()
        return torch.bmm(query[..., : self.nope_dim].transpose(0, 1), key_up).transpose(0, 1)

    def _values(self, latent: torch.Tensor) -> torch.Tensor:
        """The value up-projection of the attention-weighted latent: [T, heads, latent] → [T, heads, v], written
        by the batched GEMM straight into a row-major buffer (o_proj reads it with no copy)."""
        _, value_up = self.up_projections()
        out = latent.new_empty(latent.shape[0], self.heads, self.v_dim)
        torch.bmm(latent.transpose(0, 1), value_up.transpose(1, 2), out=out.transpose(0, 1))
        return out

    def _expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached rows [L, 1, latent + rope] → per-head keys [L, heads, nope + rope] and values [L, heads, v]."""
        latent, k_pe = rows[:, 0].split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(rows.shape[0], self.heads, self.nope_dim + self.v_dim)
        k_nope, values = kv.split([self.nope_dim, self.v_dim], dim=-1)
        keys = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.heads, -1)), dim=-1)
        return keys, values

    def finish(self, attended: torch.Tensor) -> torch.Tensor:
        """o_proj of the per-head attention output [T, heads, v]."""
        return apply_linear(self.o_proj, attended.reshape(attended.shape[0], -1))

    def forward(self, x: torch.Tensor, batch: AttentionBatch, cache_k, cache_v) -> torch.Tensor:
        inputs, stored = self._project(x, batch.positions, (cache_k, batch.write_index))
        return self.finish(self.attend(inputs, batch, cache_k, cache_v, stored))

def build(config: dict, spec: ModelSpec, routing: Routing | None = None,
          attention: type[nn.Module] = MultiHeadLatentAttention) -> MoECausalLM:
    """The model of a DeepSeek-V2 config; DeepSeek-V3 passes its own `routing` (afd.models.deepseek_v3), V3.2 also
    its sparse `attention` (afd.models.deepseek_v32)."""
    hidden = spec.hidden_size
    routing = routing or Routing(
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
        DecoderLayer(attention(config), mlp(is_moe), hidden, spec.rms_norm_eps)
        for is_moe in spec.moe_layers
    ]
    return MoECausalLM(spec, layers)
