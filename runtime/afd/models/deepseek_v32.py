"""DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention (DSA) — each query attends to `index_topk` keys.

A lightning indexer scores every earlier token for each query with `index_n_heads` small heads: its
queries come from the query LoRA's latent (`wq_b`), its one key per token from the layer input (`wk`,
then a LayerNorm), both rotated on their first `qk_rope_head_dim` dims in halves (not in pairs as
MLA's are), and a per-head weight from the input (`weights_proj`). A token's score is
Σ_h weight_h · relu(q_h · k / √index_head_dim); MLA then attends to the `index_topk` best-scored keys
only, in prefill as in the absorbed decode, and to every key while a sequence holds no more.

The index keys are cached per token beside the latent rows: one more [rows, index_head_dim] tensor per
layer at the same cache rows (KVLayout.index_dim), so blocks, prefix sharing and eviction cover them.
Everything else — MoE, noaux_tc router, YaRN, dense first layers, the unread MTP layers — is V3's.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from afd.models import deepseek_v2, deepseek_v3
from afd.models.decoder import MoECausalLM
from afd.models.dsa import index_scores, chosen_keys, masked_attention, prompt_choices
from afd.models.layers import apply_linear, apply_rope_halves, fused_glue
from afd.models.paged_attention import AttentionBatch, prompt_attention, single_tokens
from afd.models.spec import ModelSpec

ARCHES = ("deepseek_v32",)


class LightningIndexer(nn.Module):
    """The indexer's projections (checkpoint names under `self_attn.indexer`): what scores keys for a query."""

    def __init__(self, config: dict):
        super().__init__()
        hidden = config["hidden_size"]
        self.heads, self.head_dim = int(config.get("index_n_heads") or 64), int(config.get("index_head_dim") or 128)
        self.rope_dim = config["qk_rope_head_dim"]
        self.wq_b = nn.Linear(config["q_lora_rank"], self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, self.heads, bias=False)
        self.weights_proj.keep_float32 = True  # as transformers keeps it (afd.models.loader.build_share)
        self.scale = self.head_dim**-0.5

    def project(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(index queries [T, heads, dim], index keys [T, dim], head weights [T, heads] float32) of the layer
        input `x` [T, hidden] and the query LoRA's normed latent [T, q_lora_rank]."""
        tokens, rope = x.shape[0], self.rope_dim
        q = apply_linear(self.wq_b, q_latent).view(tokens, self.heads, self.head_dim)
        k = self.k_norm(apply_linear(self.wk, x)).unsqueeze(1)  # [T, 1, dim]
        q = torch.cat((apply_rope_halves(q[..., :rope], cos, sin), q[..., rope:]), dim=-1)
        k = torch.cat((apply_rope_halves(k[..., :rope], cos, sin), k[..., rope:]), dim=-1)
        if type(self.weights_proj) is nn.Linear:  # float32 (keep_float32) in a 16-bit model: its input too
            x = x.to(self.weights_proj.weight.dtype)
        weights = apply_linear(self.weights_proj, x).float() * self.heads**-0.5
        return q, k[:, 0], weights


class SparseLatentAttention(deepseek_v2.MultiHeadLatentAttention):
    """MLA whose queries attend to the indexer's top `index_topk` keys (module docstring); its cache is MLA's
    latent rows plus one index key per token (a third per-layer tensor, `cache_index`)."""

    def __init__(self, config: dict):
        super().__init__(config)
        self.indexer = LightningIndexer(config)
        self.index_topk = int(config.get("index_topk") or 2048)
        self.kv_layout = replace(self.kv_layout, index_dim=self.indexer.head_dim)

    def _side_inputs(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor) -> tuple:
        """The indexer's (queries, keys, head weights), after MLA's three inputs."""
        return self.indexer.project(x, q_latent, *self.rotary(positions))

    def attend(self, inputs: tuple, batch: AttentionBatch, cache_k, cache_v, cache_index,
               stored: bool = False) -> torch.Tensor:
        """Store the latent rows (unless `stored`) and index keys, attend to the chosen keys: [T, heads, v].
        While no sequence of the step holds more than `index_topk` keys this is dense MLA."""
        query, key, _, index_q, index_k, index_w = inputs
        cache_index[batch.write_index] = index_k.to(cache_index.dtype)
        if not stored:
            cache_k[batch.write_index] = key.to(cache_k.dtype)
        if 0 < batch.max_len <= self.index_topk and not fused_glue(query):  # nothing sparse in the step
            return super().attend(inputs, batch, cache_k, cache_v, stored=True)
        # on CUDA a one-token sequence always takes the sparse kernels (all its keys while it holds no more than
        # index_topk): a decode graph (which knows no lengths) and an eager step round it alike
        if batch.max_new == 1:
            return self._values(self._decode(query, index_q, index_w, batch, cache_k, cache_index))
        out = query.new_empty(query.shape[0], self.heads, self.v_dim)
        if batch.single_longest:  # decodes beside prompts
            tokens = single_tokens(batch)
            out[tokens] = self._values(self._single_tokens(query[tokens], index_q[tokens], index_w[tokens], batch,
                                                           cache_k, cache_index))
        if batch.prompts is not None:
            out[batch.prompts.tokens] = self._prompts(query, index_q, index_w, batch, cache_k, cache_index)
        return out

    def _decode(self, query, index_q, index_w, batch: AttentionBatch, cache_k, cache_index) -> torch.Tensor:
        """One new token per sequence: [B, heads, latent]."""
        if batch.block_table is None:  # every sequence adds one token: the flat tokens are the sequences
            return self._single_tokens(query, index_q, index_w, batch, cache_k, cache_index)
        return self._paged_tokens(query, index_q, index_w, batch.block_table, batch.seq_lens, batch.block_size,
                                  cache_k, cache_index)

    def _single_tokens(self, query, index_q, index_w, batch: AttentionBatch, cache_k, cache_index) -> torch.Tensor:
        """The one-token sequences of a step (beside prompts, or all of a CPU decode step): [S, heads, latent]."""
        if batch.single_table is not None:
            return self._paged_tokens(query, index_q, index_w, batch.single_table, batch.single_lens,
                                      batch.block_size, cache_k, cache_index)
        rows = batch.key_index[batch.single_seqs, : batch.single_longest]
        return self._sparse_latent(query, index_q, index_w, rows, batch.single_lens, cache_k, cache_index)

    def _paged_tokens(self, query, index_q, index_w, table, lengths, block_size: int, cache_k,
                      cache_index) -> torch.Tensor:
        """One query per sequence through its block table [S, W]: [S, heads, latent], by the Triton kernels on CUDA
        (capturable: what the decode graphs replay), else by the plain-torch path over the table's rows."""
        if fused_glue(query):
            # local import: Triton is optional (CPU installs have none): loaded where its kernel runs
            from afd.kernels.sparse_mla import sparse_latent_decode

            return sparse_latent_decode(
                self._absorb_latent(query), query[..., self.nope_dim :], cache_k, self.kv_lora_rank, index_q,
                index_w, cache_index, self.indexer.scale, self.index_topk, table, lengths, block_size, self.scale)
        positions = torch.arange(table.shape[1] * block_size, device=query.device)
        rows = table[:, positions // block_size].long() * block_size + positions % block_size  # [S, W * block]
        return self._sparse_latent(query, index_q, index_w, rows, lengths, cache_k, cache_index)

    def _sparse_latent(self, query, index_q, index_w, rows, lengths, cache_k, cache_index) -> torch.Tensor:
        """One query per sequence over its chosen cached rows, absorbed: [S, heads, latent]. `rows` [S, L]: each
        sequence's cache rows by position, the first `lengths` [S] of them its own."""
        count, length = rows.shape
        allowed = torch.arange(length, device=rows.device)[None, :] < lengths[:, None]  # [S, L]
        scores = index_scores(index_q.unsqueeze(1), index_w.unsqueeze(1), cache_index[rows], self.indexer.scale)
        chosen = chosen_keys(scores[:, 0], allowed, self.index_topk)  # [S, L]
        latents = cache_k[rows].transpose(1, 2).to(query.dtype)  # [S, 1, L, latent + rope]
        return F.scaled_dot_product_attention(
            self._absorb(query).unsqueeze(1), latents, latents[..., : self.kv_lora_rank],
            attn_mask=chosen.view(count, 1, 1, length), scale=self.scale)[:, 0]

    def _prompts(self, query, index_q, index_w, batch: AttentionBatch, cache_k, cache_index) -> torch.Tensor:
        """Every prompt's (or chunk's) queries over its chosen keys: [Q, heads, v] for the step's prompt tokens. On
        CUDA in the latent space, as decode (`afd.kernels.sparse_mla`); elsewhere its keys and values expanded
        per head, as MLA's prefill and transformers compute them."""
        layout = batch.prompts
        index_keys = cache_index[layout.key_rows]
        q, index_q, index_w = query[layout.tokens], index_q[layout.tokens], index_w[layout.tokens]
        out = q.new_empty(q.shape[0], self.heads, self.v_dim)
        if fused_glue(query):
            # local import: Triton is optional (CPU installs have none): loaded where its kernel runs
            from afd.kernels.sparse_mla import sparse_latent_prefill

            absorbed = self._absorb_latent(q)  # [Q, heads, latent]
            for q0, q1, k0, k1 in layout.spans_host:
                if k1 - k0 <= self.index_topk:  # every query sees all its keys: dense MLA, for this prompt alone
                    keys, values = self._expand(cache_k[layout.key_rows[k0:k1]].to(query.dtype))
                    out[q0:q1] = prompt_attention(q[q0:q1], keys, values, self.scale)
                    continue
                latent = sparse_latent_prefill(
                    absorbed[q0:q1], q[q0:q1, :, self.nope_dim :], cache_k, self.kv_lora_rank, index_q[q0:q1],
                    index_w[q0:q1], index_keys[k0:k1], layout.key_rows[k0:k1], self.indexer.scale, self.index_topk,
                    self.scale)
                out[q0:q1] = self._values(latent)
            return out
        keys, values = self._expand(cache_k[layout.key_rows].to(query.dtype))
        for q0, q1, k0, k1 in layout.spans_host:
            chosen = prompt_choices(index_q[q0:q1], index_w[q0:q1], index_keys[k0:k1], self.indexer.scale,
                                    self.index_topk)
            out[q0:q1] = masked_attention(q[q0:q1], keys[k0:k1], values[k0:k1], chosen, self.scale)
        return out

    def forward(self, x: torch.Tensor, batch: AttentionBatch, cache_k, cache_v, cache_index) -> torch.Tensor:
        inputs, stored = self._project(x, batch.positions, (cache_k, batch.write_index))
        return self.finish(self.attend(inputs, batch, cache_k, cache_v, cache_index, stored))


def build(config: dict, spec: ModelSpec) -> MoECausalLM:
    return deepseek_v2.build(config, spec, deepseek_v3.routing(config, spec), SparseLatentAttention)
