"""One stage split (afd.stages) behind the attention runner, the decode graphs and the vLLM plugin."""

import pytest

from afd.graphs.buckets import stage_split
from afd.layout import SeqLayout, split_layout
from afd.stages import stage_cut, stage_rows, stage_tokens
from afd.vllm_plugin.link import LinkPlan


def test_the_cut_evens_the_tokens_and_never_splits_a_sequence():
    assert stage_cut([5, 1, 1, 3], 2) == 1  # 5 | 5
    assert stage_cut([7], 2) == 1  # one sequence: stage 1 stays empty
    assert stage_tokens([2, 2, 3], 2) == (4, 3) and stage_tokens([2, 2, 3], 1) == (7,)


@pytest.mark.parametrize("rows, min_split, want", [(9, 0, (4, 5)), (9, 10, (9, 0)), (10, 10, (5, 5)), (1, 0, (1, 0))])
def test_every_user_of_the_split_agrees(rows, min_split, want):
    layout = SeqLayout(tuple(() for _ in range(rows)), (0,) * rows, (1,) * rows)
    plan = LinkPlan(spec=None, crossing=(), gate_on_attention=False, stages=2, dbo_min_tokens=min_split)
    assert stage_rows(rows, 2, min_split) == want
    assert tuple(part.num_tokens for part in split_layout(layout, 2, min_split)) == want
    assert stage_split(rows, 2, min_split) == want
    assert plan.stage_rows(rows) == want  # the vLLM engine honours dboMinTokens too
