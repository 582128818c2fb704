"""How a step splits into stages (micro-batches): the one policy, pure and torch-free.

`StagePolicy` (the `stages` and `dbo_min_tokens` settings) is what the attention runner
(`afd.step.layout.split_layout`), the decode graphs and the vLLM plugin's link all ask, so
`dboMinTokens` means the same on every attention engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StagePolicy:
    """A step's stages (1 or 2) and the fewest tokens a step needs to be split in two.

    One stage, or a step of fewer than `dbo_min_tokens` tokens, stays whole: splitting pays
    only when the FFN's compute, not its weight reads, dominates (each stage reads the touched
    experts again).
    """

    stages: int = 1
    dbo_min_tokens: int = 0

    @classmethod
    def of(cls, config) -> "StagePolicy":
        """The policy an `AFDConfig` sets (its `stages` and `dbo_min_tokens`)."""
        return cls(config.stages, config.dbo_min_tokens)

    def cut(self, new_lens: Sequence[int]) -> int:
        """How many of the step's sequences (in order) run in stage 0; the rest run in stage 1.

        A step that stays whole (see the class) puts every sequence in stage 0. Otherwise the cut
        gives two contiguous runs of the most even token counts, the first no larger on a tie; one
        sequence cannot be split (its tokens attend to each other), so stage 1 is then empty.
        """
        if self.stages == 1 or sum(new_lens) < self.dbo_min_tokens or len(new_lens) < 2:
            return len(new_lens)
        total, best, best_gap, running = sum(new_lens), 1, None, 0
        for cut in range(1, len(new_lens)):
            running += new_lens[cut - 1]
            gap = abs(total - 2 * running)
            if best_gap is None or gap < best_gap:
                best, best_gap = cut, gap
        return best

    def tokens(self, new_lens: Sequence[int]) -> tuple[int, ...]:
        """Tokens of each stage (`stages` entries, the second possibly 0)."""
        if self.stages == 1:
            return (sum(new_lens),)
        cut = self.cut(new_lens)
        return (sum(new_lens[:cut]), sum(new_lens[cut:]))

    def rows(self, rows: int) -> tuple[int, ...]:
        """Tokens of each stage when any row may go to either stage (a padded decode batch of one token
        per sequence, or an engine that splits only the FFN exchange)."""
        return self.tokens((1,) * rows)
