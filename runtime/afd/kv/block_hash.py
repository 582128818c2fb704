"""Names of full KV-cache blocks for prefix caching: a hash chain over their token ids.

Block i's name is a hash of block i-1's name and block i's token ids, so equal names mean equal
prefixes (up to a 128-bit collision). The chain starts from the request's `cache_salt` (vLLM's
field): requests salted differently, or one salted and one not, never share a block. Torch-free.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b
from typing import Sequence

UNSALTED = bytes(16)  # the chain's root when a request names no salt


def chain_root(salt: str | None) -> bytes:
    """The name block 0 hangs from: the salt's own hash, or `UNSALTED`."""
    if salt is None:
        return UNSALTED
    return blake2b(b"afd-cache-salt\0" + salt.encode(), digest_size=16).digest()


def block_hashes(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The names of the full blocks of `tokens` (a partly filled last block has none)."""
    names, parent = [], chain_root(salt)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = blake2b(parent, digest_size=16)
        digest.update(array("q", tokens[start: start + block_size]).tobytes())
        parent = digest.digest()
        names.append(parent)
    return names
