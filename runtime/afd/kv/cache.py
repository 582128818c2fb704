"""Paged KV cache: per layer, one [blocks × block_size, heads, dim] pair of tensors.

A layout whose values live in its keys (MLA's latent cache) stores one tensor; its
value tensor is a view of the keys' first columns. A layout with an `index_dim` (DeepSeek-V3.2's
indexer keys) holds one more [rows, index_dim] tensor, addressed by the same rows: whatever
owns, shares or frees a block owns, shares or frees its index keys too.

Sequences own lists of blocks (their block tables); memory is reserved per block,
not per maximum length, so the cache holds as many tokens as its budget allows. Which blocks are
free, shared or cached for a prefix is its `pool`'s (`afd.kv.block_pool`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from afd.kv.block_pool import BlockPool
from afd.models.spec import KVLayout

DEFAULT_BLOCK_SIZE = 16


class KVBlocks:
    """The block arithmetic of a KV cache of `num_blocks` blocks of `block_size` tokens (no tensors:
    what admission needs, also where the cache lives in another process), and who holds which block."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pool = BlockPool(num_blocks, block_size)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


class KVCache(KVBlocks):
    """Keys and values of `num_blocks` blocks of `block_size` tokens each, for every layer."""

    def __init__(
        self,
        layouts: Sequence[KVLayout],
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ):
        if num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, got {num_blocks}")
        super().__init__(num_blocks, block_size)
        self.scratch_block = num_blocks  # one extra block, never allocated: padded graph rows write here
        self.rows = (num_blocks + 1) * block_size
        self.layouts = list(layouts)
        self.dtype, self.device = dtype, torch.device(device)  # dtype: the model's, or FP8 (afd.models.kv_dtype)
        self.keys = [self.new_rows(lay.heads, lay.key_dim) for lay in self.layouts]
        self.values = [
            keys[:, :, : lay.value_dim] if lay.values_in_keys else self.new_rows(lay.heads, lay.value_dim)
            for keys, lay in zip(self.keys, self.layouts)
        ]
        if dtype == torch.float8_e4m3fn and any(lay.index_dim for lay in self.layouts):
            raise ValueError("an FP8 KV cache (kv_cache_dtype=fp8) does not hold DeepSeek-V3.2's index keys yet: "
                             "its sparse kernels read the model dtype; use kv_cache_dtype=auto")
        self.index_keys = [torch.zeros(self.rows, lay.index_dim, dtype=dtype, device=self.device) if lay.index_dim
                           else None for lay in self.layouts]

    def new_rows(self, heads: int, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zeroed per-layer cache tensor [rows, heads, dim], one row per token slot of every block (the scratch
        block's too), addressed by the same block ids (default dtype: the cache's)."""
        return torch.zeros(self.rows, heads, dim, dtype=dtype or self.dtype, device=self.device)

    @classmethod
    def for_tokens(cls, layouts, num_tokens: int, dtype, device, block_size: int = DEFAULT_BLOCK_SIZE) -> "KVCache":
        return cls(layouts, -(-num_tokens // block_size), dtype, device, block_size)

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        """Layer `index`'s (keys, values), then its index keys where its layout has them."""
        extra = () if self.index_keys[index] is None else (self.index_keys[index],)
        return (self.keys[index], self.values[index], *extra)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor holding cache rows, each once (value views of keys left out): what copies rows."""
        own_values = [v for v, lay in zip(self.values, self.layouts) if not lay.values_in_keys]
        return self.keys + own_values + [t for t in self.index_keys if t is not None]

    @property
    def free_blocks(self) -> int:
        """Blocks free for new sequences, cached prefixes nobody owns included."""
        return self.pool.free_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return self.pool.can_allocate(num_tokens)

    def allocate(self, num_tokens: int) -> list[int]:
        """Blocks holding `num_tokens` tokens; `afd.kv.block_pool.CacheFullError` if too few are free."""
        return self.pool.allocate(num_tokens)

    def release(self, blocks: Sequence[int]) -> None:
        self.pool.release(blocks)

    @property
    def usage(self) -> float:
        """Owned blocks' share (cached blocks nobody owns count as free)."""
        return 1.0 - self.pool.free_blocks / self.num_blocks

    @property
    def nbytes(self) -> int:
        """Device bytes the cache holds (value views of keys counted once, index keys included)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def token_bytes(self) -> int:
        """Bytes one token takes in this cache, all layers, in its dtype."""
        return self.bytes_per_token(self.layouts, self.dtype)

    @staticmethod
    def bytes_per_token(layouts: Sequence[KVLayout], dtype: torch.dtype) -> int:
        element = torch.empty(0, dtype=dtype).element_size()
        return sum(layout.elements_per_token for layout in layouts) * element
