"""What the grouped-query attention families (Qwen3-MoE, GLM-4.x) share: the q/k/v/o projections, the paged
cache's layout, one fused q/k/v GEMM once loaded, and attention over the cache. A family adds its norms and
rotary in `_project`."""

from __future__ import annotations

import torch
from torch import nn

from afd.models.layers import apply_linear, fuse_linears
from afd.models.paged_attention import AttentionBatch, cached_attention
from afd.models.spec import KVLayout


class GQAttention(nn.Module):
    """GQA over `num_attention_heads` query and `num_key_value_heads` key/value heads; q, k and v carry a bias with
    `attention_bias`, o_proj only with `o_bias` too."""

    def __init__(self, config: dict, o_bias: bool):
        super().__init__()
        hidden = config["hidden_size"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or hidden // self.heads
        self.out_head_dim = self.head_dim  # per head, of what `attend` returns
        bias = bool(config.get("attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias and o_bias)
        self.kv_layout = KVLayout(self.kv_heads, self.head_dim, self.head_dim)
        self.scale = self.head_dim**-0.5
        self.qkv_weight: torch.Tensor | None = None  # fuse_projections(): q, k and v in one GEMM

    def fuse_projections(self) -> None:
        """Once the weights are loaded: q_proj, k_proj and v_proj become views of one weight, one GEMM (not when
        they carry biases: `fuse_linears` leaves them as they are)."""
        self.qkv_weight = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query [T, heads, d] and key [T, kv_heads, d] as attention reads them, and the value [T, kv_heads, d]."""
        return self._project(x, positions, None)[0]

    def _project(self, x: torch.Tensor, positions: torch.Tensor, store) -> tuple[tuple, bool]:
        """`project`'s inputs, and whether the key and value are in the cache already (`store`: (cache_k, cache_v,
        write index) for a family that writes them in the same launch, else ignored)."""
        raise NotImplementedError

    def attend(self, inputs: tuple, batch: AttentionBatch, cache_k, cache_v, stored: bool = False) -> torch.Tensor:
        """Store the keys and values (unless `stored`), attend: [T, heads, head_dim]."""
        return cached_attention(*inputs, cache_k, cache_v, batch, self.scale, stored)

    def finish(self, attended: torch.Tensor) -> torch.Tensor:
        return apply_linear(self.o_proj, attended.reshape(attended.shape[0], -1))

    def forward(self, x: torch.Tensor, batch: AttentionBatch, cache_k, cache_v) -> torch.Tensor:
        inputs, stored = self._project(x, batch.positions, (cache_k, cache_v, batch.write_index))
        return self.finish(self.attend(inputs, batch, cache_k, cache_v, stored))
