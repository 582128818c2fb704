"""How a step splits into stages (micro-batches): the one policy, pure and torch-free.

Used by the attention runner (`afd.layout.split_layout`), the decode-graph
buckets (`afd.graphs.buckets.stage_split`) and the vLLM plugin's link, so `dboMinTokens`
means the same on every attention engine.
"""

from __future__ import annotations

from typing import Sequence


def stage_cut(new_lens: Sequence[int], stages: int, min_split: int = 0) -> int:
    """How many of the step's sequences (in order) run in stage 0; the rest run in stage 1.

    One stage, or a step of fewer than `min_split` tokens, stays whole: splitting pays only
    when the FFN's compute, not its weight reads, dominates (each stage reads the touched
    experts again). Otherwise the cut gives two contiguous runs of the most even token
    counts, the first no larger on a tie; one sequence cannot be split (its tokens attend
    to each other), so stage 1 is then empty.
    """
    if stages == 1 or sum(new_lens) < min_split or len(new_lens) < 2:
        return len(new_lens)
    total, best, best_gap, running = sum(new_lens), 1, None, 0
    for cut in range(1, len(new_lens)):
        running += new_lens[cut - 1]
        gap = abs(total - 2 * running)
        if best_gap is None or gap < best_gap:
            best, best_gap = cut, gap
    return best


def stage_tokens(new_lens: Sequence[int], stages: int, min_split: int = 0) -> tuple[int, ...]:
    """Tokens of each stage (`stages` entries, the second possibly 0)."""
    cut = stage_cut(new_lens, stages, min_split)
    if stages == 1:
        return (sum(new_lens),)
    return (sum(new_lens[:cut]), sum(new_lens[cut:]))


def stage_rows(rows: int, stages: int, min_split: int = 0) -> tuple[int, ...]:
    """Tokens of each stage when any row may go to either stage (one token per sequence, or an
    engine that splits only the FFN exchange)."""
    return stage_tokens((1,) * rows, stages, min_split)
