"""Slot-based KV cache: one preallocated [slots, max_len, heads, dim] pair per layer."""

from __future__ import annotations

from typing import Sequence

import torch


class CacheFullError(RuntimeError):
    """No free slot: the caller must wait for a sequence to finish."""


class KVCache:
    """Keys and values of up to `num_slots` sequences of at most `max_len` tokens each."""

    def __init__(
        self,
        layouts: Sequence[tuple[int, int, int]],
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_slots, self.max_len = num_slots, max_len
        self.keys = [torch.zeros(num_slots, max_len, heads, k_dim, dtype=dtype, device=device) for heads, k_dim, _ in layouts]
        self.values = [torch.zeros(num_slots, max_len, heads, v_dim, dtype=dtype, device=device) for heads, _, v_dim in layouts]
        self._free = list(range(num_slots - 1, -1, -1))

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[index], self.values[index]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} KV-cache slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not an allocated KV-cache slot")
        self._free.append(slot)

    @staticmethod
    def bytes_per_token(layouts: Sequence[tuple[int, int, int]], dtype: torch.dtype) -> int:
        element = torch.empty(0, dtype=dtype).element_size()
        return sum(heads * (k_dim + v_dim) for heads, k_dim, v_dim in layouts) * element
