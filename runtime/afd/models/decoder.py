"""One decoder-only MoE model shape shared by the families, cut into role-sized pieces.

Module names mirror the Hugging Face checkpoints (`model.layers.N.self_attn...`), so
loading is a name match. Each decoder layer exposes its halves separately: the
attention half (norm, attention, residual), the FFN half (norm + MLP/MoE), and the
two pieces of the FFN half that exist when the router runs on attention.
"""

from __future__ import annotations

import torch
from torch import nn

from afd.models.paged_attention import AttentionBatch
from afd.models.layers import MoE, RMSNorm
from afd.models.spec import KVLayout, ModelSpec


class DecoderLayer(nn.Module):
    """input_layernorm → self_attn → residual; post_attention_layernorm → mlp → residual."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.input_layernorm: RMSNorm | None = RMSNorm(hidden, eps)
        self.self_attn: nn.Module | None = self_attn
        self.post_attention_layernorm: RMSNorm | None = RMSNorm(hidden, eps)
        self.mlp: nn.Module | None = mlp

    def attention_half(self, h: torch.Tensor, batch: AttentionBatch, cache: tuple,
                       normed: torch.Tensor | None = None) -> torch.Tensor:
        """h + attention(norm(h)): the part that always stays on attention ranks (`normed`: norm(h), when known)."""
        return h + self.self_attn(self.input_layernorm(h) if normed is None else normed, batch, *cache)

    # The attention half in three pieces, for piecewise graphs (afd.graphs.mixed): the first and the
    # last are shaped by the token count alone; the middle one reads the step's cache metadata.
    def attention_inputs(self, h: torch.Tensor, positions: torch.Tensor) -> tuple:
        """(query, key, value or None) of norm(h) at `positions`: what the cache and the kernel take."""
        return self.self_attn.project(self.input_layernorm(h), positions)

    def attend(self, inputs: tuple, batch: AttentionBatch, cache: tuple) -> torch.Tensor:
        """Store the keys and values of `inputs` in the cache and attend: [T, heads, value dim]."""
        return self.self_attn.attend(inputs, batch, *cache)

    def attention_output(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """h + o_proj(attended): the residual stream after attention."""
        return h + self.self_attn.finish(attended)

    def ffn_half(self, h: torch.Tensor) -> torch.Tensor:
        """mlp(norm(h)), without the residual: what an FFN rank returns when it owns the gate."""
        return self.mlp(self.post_attention_layernorm(h))

    def gate_half(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h), router logits): what attention ships when the gate runs on attention."""
        x = self.post_attention_layernorm(h)
        return x, self.mlp.gate(x)

    def expert_half(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Experts (and shared experts) of normed `x` routed by shipped logits."""
        return self.mlp.from_logits(x, router_logits)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoE)


class MoECausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head; single-device shaped."""

    def __init__(self, spec: ModelSpec, layers: list[DecoderLayer]):
        super().__init__()
        self.spec = spec
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # [T, hidden]

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h)).float()  # [B, vocab]

    def kv_layouts(self) -> list[KVLayout]:
        """What each layer caches per token."""
        return [layer.self_attn.kv_layout for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv_cache,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The monolithic path: every layer whole, logits of each sequence's last token (or of token `rows`).
        Each residual add is one launch with the norm after it (`RMSNorm.add_forward`): the same sums and norms
        as `attention_half` then `ffn_half`, two launches a layer fewer."""
        h = self.embed(input_ids)
        x = self.layers[0].input_layernorm(h)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.model.norm]
        for index, (layer, next_norm) in enumerate(zip(self.layers, norms)):
            h, x = layer.post_attention_layernorm.add_forward(layer.self_attn(x, batch, *kv_cache.layer(index)), h)
            h, x = next_norm.add_forward(layer.mlp(x), h)
        return self.lm_head(x[batch.last_token if rows is None else rows]).float()  # x: every token's final norm
