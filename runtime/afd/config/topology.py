"""AFD group topology: rank mapping and the crossing-layer list.

Torch-free on purpose: the operator and the runtime both import this module, so the
shape of a group is computed by one piece of code on both sides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

_TOPOLOGY_RE = re.compile(r"^\s*(\d+)\s*A\s*(\d+)\s*F\s*$", re.IGNORECASE)


class TopologyError(ValueError):
    """A topology string or rank that cannot describe an AFD group."""


@dataclass(frozen=True)
class Topology:
    """`num_attention` attention ranks feeding `num_ffn` FFN ranks (A >= F >= 1)."""

    num_attention: int
    num_ffn: int

    def __post_init__(self) -> None:
        if self.num_attention < 1:
            raise TopologyError(f"topology {self}: needs at least one attention rank, got {self.num_attention}")
        if self.num_ffn < 1:
            raise TopologyError(f"topology {self}: needs at least one FFN rank, got {self.num_ffn}")
        if self.num_attention < self.num_ffn:
            raise TopologyError(
                f"topology {self}: needs at least as many attention ranks as FFN ranks "
                f"(A >= F), got A={self.num_attention}, F={self.num_ffn}"
            )

    def __str__(self) -> str:
        return f"{self.num_attention}A{self.num_ffn}F"

    @classmethod
    def parse(cls, text: str) -> "Topology":
        """Parse `"4A2F"` (case-insensitive) into a validated topology."""
        match = _TOPOLOGY_RE.match(str(text))
        if not match:
            raise TopologyError(
                f"topology {text!r}: expected '<A>A<F>F' with whole numbers, e.g. '4A2F'"
            )
        return cls(int(match.group(1)), int(match.group(2)))

    def ffn_rank_of(self, attention_rank: int) -> int:
        """FFN rank serving `attention_rank`: balanced contiguous blocks.

        When F divides A this is the seed's `a // (A/F)`; otherwise the first
        `A % F` FFN ranks serve one attention rank more than the rest.
        """
        self._check_rank("attention", attention_rank, self.num_attention)
        base, extra = divmod(self.num_attention, self.num_ffn)
        big_block_span = extra * (base + 1)
        if attention_rank < big_block_span:
            return attention_rank // (base + 1)
        return extra + (attention_rank - big_block_span) // base

    def attention_ranks_of(self, ffn_rank: int) -> tuple[int, ...]:
        """Attention ranks served by `ffn_rank`, in ascending order."""
        self._check_rank("ffn", ffn_rank, self.num_ffn)
        return tuple(a for a in range(self.num_attention) if self.ffn_rank_of(a) == ffn_rank)

    @staticmethod
    def _check_rank(role: str, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise TopologyError(f"{role} rank {rank} is out of range 0..{size - 1}")


def crossing_layers(moe_layers: Sequence[bool], gate_on_attention: bool) -> tuple[int, ...]:
    """Decoder layers whose FFN runs on the FFN ranks.

    With the gate on the FFN side every layer crosses; with the gate on attention the
    dense layers stay on attention and only expert layers cross.
    """
    if not gate_on_attention:
        return tuple(range(len(moe_layers)))
    return tuple(i for i, is_moe in enumerate(moe_layers) if is_moe)


def shard_range(count: int, shards: int, shard: int) -> tuple[int, int]:
    """[start, stop) of shard `shard` when `count` items (experts, MLP columns) go to `shards` shards.

    Balanced contiguous blocks, like `Topology.ffn_rank_of`: the first `count % shards` shards
    take one item more, so E not divisible by G still places every expert exactly once.
    """
    if not 0 <= shard < shards:
        raise TopologyError(f"shard {shard} is out of range 0..{shards - 1}")
    base, extra = divmod(count, shards)
    start = shard * base + min(shard, extra)
    return start, start + base + (1 if shard < extra else 0)
