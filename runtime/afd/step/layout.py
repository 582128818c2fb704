"""The sequences of one step (`SeqLayout`) and their split into micro-batches (stages).

Pure and torch-free, below the engine, the graphs and the runners that all build or read it."""

from __future__ import annotations

from dataclasses import dataclass

from afd.step.stages import StagePolicy


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


def split_layout(layout: SeqLayout, policy: StagePolicy) -> list[SeqLayout]:
    """`policy.stages` micro-batches (some possibly empty) covering `layout` in order (`StagePolicy.cut`)."""
    if policy.stages == 1:
        return [layout]
    cut = policy.cut(layout.new_lens)
    return [layout.part(0, cut), layout.part(cut, len(layout.new_lens))]
