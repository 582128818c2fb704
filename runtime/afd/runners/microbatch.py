"""Splitting a step's sequences into micro-batches (stages) for the attention/FFN ping-pong."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class SeqLayout:
    """The sequences of one step: cache blocks, tokens already cached, tokens added now."""

    block_tables: tuple[tuple[int, ...], ...]
    context_lens: tuple[int, ...]
    new_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.new_lens)

    def part(self, start: int, stop: int) -> "SeqLayout":
        return SeqLayout(self.block_tables[start:stop], self.context_lens[start:stop], self.new_lens[start:stop])


def split_point(new_lens: Sequence[int]) -> int:
    """Index that cuts the sequences into two contiguous runs of the most even token counts.

    One sequence cannot be split (its tokens attend to each other), so the second
    micro-batch is then empty.
    """
    if len(new_lens) < 2:
        return len(new_lens)
    total, best, best_gap, running = sum(new_lens), 1, None, 0
    for cut in range(1, len(new_lens)):
        running += new_lens[cut - 1]
        gap = abs(total - 2 * running)
        if best_gap is None or gap < best_gap:
            best, best_gap = cut, gap
    return best


def split_layout(layout: SeqLayout, stages: int, min_split: int = 0) -> list[SeqLayout]:
    """`stages` micro-batches (some possibly empty) covering `layout` in order; a step of
    fewer than `min_split` tokens stays whole in the first."""
    if stages == 1:
        return [layout]
    cut = split_point(layout.new_lens) if layout.num_tokens >= min_split else len(layout.new_lens)
    return [layout.part(0, cut), layout.part(cut, len(layout.new_lens))]
