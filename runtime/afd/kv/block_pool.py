"""Which blocks of a KV cache are free, how many owners the others have, and which hold a published prefix.

A block is owned by the sequences whose block tables hold it (the choices of one prompt, and requests that hit
the same cached prefix, share blocks: `share` adds an owner, `release` drops one). A block holding a full block
of prompt tokens whose keys and values a committed step wrote may be `publish`ed under its name (`block_hash`):
`lookup` finds it for a later request with the same prefix. A published block nobody owns stays cached among the
free blocks; `allocate` takes never-published free blocks first, then evicts the least recently released cached
ones (their names are forgotten). So `free_blocks` counts cached-but-free blocks as free. Torch-free.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class CacheFullError(RuntimeError):
    """Not enough free blocks: the caller must wait for a sequence to finish."""


class BlockPool:
    """The free, owned and cached blocks of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # never published (or evicted): popped from the end
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # published, nobody owns them: LRU first
        self._extra: dict[int, int] = {}  # owners beyond the first, of shared blocks only
        self._by_name: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}

    # -- owners ------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks `allocate` may hand out: never-published ones and cached ones nobody owns."""
        return len(self._free) + len(self._cached_free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.free_blocks

    def allocate(self, num_tokens: int) -> list[int]:
        """Blocks holding `num_tokens` tokens, one owner each; cached blocks are evicted (LRU first) only when the
        never-published ones run out; `CacheFullError` if too few are free."""
        needed = self.blocks_for(num_tokens)
        if needed > self.free_blocks:
            raise CacheFullError(f"{needed} KV-cache blocks needed, {self.free_blocks} of {self.num_blocks} free")
        blocks = [self._free.pop() for _ in range(min(needed, len(self._free)))]
        while len(blocks) < needed:
            block, _ = self._cached_free.popitem(last=False)
            del self._by_name[self._name_of.pop(block)]
            blocks.append(block)
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """One more owner for each of `blocks` (a cached block nobody owned gets its first)."""
        for block in blocks:
            if block in self._cached_free:
                del self._cached_free[block]
            else:
                self._extra[block] = self._extra.get(block, 0) + 1

    def release(self, blocks: Sequence[int]) -> None:
        """One owner fewer for each of `blocks`; those nobody owns any more are free (published ones stay cached,
        the table's last blocks evicted first)."""
        for block in blocks:
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"block {block} is not a KV-cache block")
        for block in reversed(blocks):
            extra = self._extra.get(block)
            if extra is not None:
                if extra == 1:
                    del self._extra[block]
                else:
                    self._extra[block] = extra - 1
            elif block in self._name_of:
                self._cached_free[block] = None
            else:
                self._free.append(block)

    @property
    def shared(self) -> int:
        """Blocks with more than one owner now."""
        return len(self._extra)

    def free_ids(self) -> list[int]:
        """Every free block (cached or not), sorted."""
        return sorted([*self._free, *self._cached_free])

    # -- published prefixes -----------------------------------------------------------------
    def publish(self, block: int, name: bytes) -> None:
        """`block` (owned) holds the full block named `name`; a name already published keeps its block."""
        if name not in self._by_name and block not in self._name_of:
            self._by_name[name], self._name_of[block] = block, name

    def lookup(self, names: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `names` that is published."""
        blocks = []
        for name in names:
            block = self._by_name.get(name)
            if block is None:
                break
            blocks.append(block)
        return blocks

    @property
    def cached_blocks(self) -> int:
        """Published blocks (owned or not)."""
        return len(self._name_of)
