"""One stage policy (afd.step.stages.StagePolicy) behind the attention runner, the decode graphs and the vLLM plugin."""

import pytest

from afd.config import AFDConfig
from afd.step.layout import SeqLayout, split_layout
from afd.runners.attention_runner import StepOptions
from afd.step.stages import StagePolicy
from afd.vllm_plugin.link import LinkPlan


def test_the_cut_evens_the_tokens_and_never_splits_a_sequence():
    assert StagePolicy(2).cut([5, 1, 1, 3]) == 1  # 5 | 5
    assert StagePolicy(2).cut([7]) == 1  # one sequence: stage 1 stays empty
    assert StagePolicy(2).tokens([2, 2, 3]) == (4, 3) and StagePolicy(1).tokens([2, 2, 3]) == (7,)
    assert StagePolicy(2).rows(7) == (3, 4) and StagePolicy(1).rows(8) == (8,)
    assert StagePolicy(2, 16).rows(8) == (8, 0) and StagePolicy(2, 16).rows(16) == (8, 8)  # a padded decode bucket


@pytest.mark.parametrize("rows, dbo_min_tokens, want",
                         [(9, 0, (4, 5)), (9, 10, (9, 0)), (10, 10, (5, 5)), (1, 0, (1, 0))])
def test_the_settings_make_one_policy_every_user_follows(rows, dbo_min_tokens, want):
    config = AFDConfig(stages=2, dbo_min_tokens=dbo_min_tokens)
    policy = StagePolicy.of(config)
    assert policy == StagePolicy(2, dbo_min_tokens) and policy.rows(rows) == want
    layout = SeqLayout(tuple(() for _ in range(rows)), (0,) * rows, (1,) * rows)
    assert tuple(part.num_tokens for part in split_layout(layout, policy)) == want  # the attention runner
    assert StepOptions.of(config).policy == policy  # the runner and the decode graphs it captures
    plan = LinkPlan(spec=None, crossing=(), gate_on_attention=False, policy=policy)
    assert plan.policy.rows(rows) == want  # the vLLM engine honours dboMinTokens too
