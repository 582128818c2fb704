"""Paged KV cache: per layer, one [blocks × block_size, heads, dim] pair of tensors.

A layout whose values live in its keys (MLA's latent cache) stores one tensor; its
value tensor is a view of the keys' first columns. A layout with an `index_dim` (DeepSeek-V3.2's
indexer keys) holds one more [rows, index_dim] tensor, addressed by the same rows: whatever
owns, shares or frees a block owns, shares or frees its index keys too.

Sequences own lists of blocks (their block tables); memory is reserved per block,
not per maximum length, so the cache holds as many tokens as its budget allows.
"""

from __future__ import annotations

from typing import Sequence

import torch

from afd.models.spec import KVLayout

DEFAULT_BLOCK_SIZE = 16


class CacheFullError(RuntimeError):
    """Not enough free blocks: the caller must wait for a sequence to finish."""


class KVBlocks:
    """The block arithmetic of a KV cache of `num_blocks` blocks of `block_size` tokens (no tensors:
    what admission needs, also where the cache lives in another process)."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        self.num_blocks, self.block_size = num_blocks, block_size

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
        rows = (num_blocks + 1) * block_size
        self.layouts = list(layouts)
        self.keys = [torch.zeros(rows, lay.heads, lay.key_dim, dtype=dtype, device=device) for lay in self.layouts]
        self.values = [
            keys[:, :, : lay.value_dim] if lay.values_in_keys
            else torch.zeros(rows, lay.heads, lay.value_dim, dtype=dtype, device=device)
            for keys, lay in zip(self.keys, self.layouts)
        ]
        self.index_keys = [torch.zeros(rows, lay.index_dim, dtype=dtype, device=device) if lay.index_dim else None
                           for lay in self.layouts]
        self._free = list(range(num_blocks - 1, -1, -1))

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
        return len(self._free)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, num_tokens: int) -> list[int]:
        """Blocks holding `num_tokens` tokens; `CacheFullError` if too few are free."""
        needed = self.blocks_for(num_tokens)
        if needed > len(self._free):
            raise CacheFullError(f"{needed} KV-cache blocks needed, {len(self._free)} of {self.num_blocks} free")
        return [self._free.pop() for _ in range(needed)]

    def release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"block {block} is not a KV-cache block")
        self._free.extend(blocks)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def nbytes(self) -> int:
        """Device bytes the cache holds (value views of keys counted once, index keys included)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @staticmethod
    def bytes_per_token(layouts: Sequence[KVLayout], dtype: torch.dtype) -> int:
        element = torch.empty(0, dtype=dtype).element_size()
        return sum(layout.elements_per_token for layout in layouts) * element
