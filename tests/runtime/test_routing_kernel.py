"""The one-kernel greedy routing equals `Routing.select`'s torch path.

Runs on a GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1 before Triton is imported,
Triton 3.7+); otherwise skips, as the Triton MoE settings tests do.
"""

import importlib.util
import os

import pytest
import torch

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
    DEVICE = "cpu"
else:
    DEVICE = None
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU or TRITON_INTERPRET=1 with Triton installed")

CASES = {  # id → (experts, top_k, norm_topk_prob, scaling_factor, scale_when_normalized)
    "deepseek-v2-lite": (64, 6, False, 1.0, True),
    "qwen3-moe": (128, 8, True, 1.0, True),
    "scaled-odd-expert-count": (160, 6, False, 16.0, True),
    "normalized-then-scaled": (40, 4, True, 2.5, True),
    "normalized-not-scaled": (40, 4, True, 2.5, False),
    "top-1": (8, 1, True, 1.0, True),
}


@pytest.mark.parametrize("tokens", [1, 37, 300])
@pytest.mark.parametrize("case", sorted(CASES))
def test_select_greedy_equals_the_torch_routing(case, tokens):
    from afd.kernels.routing import select_greedy
    from afd.models.layers import Routing

    experts, top_k, normalize, scaling, scale_when_normalized = CASES[case]
    routing = Routing(top_k=top_k, num_experts=experts, norm_topk_prob=normalize, scaling_factor=scaling,
                      scale_when_normalized=scale_when_normalized)
    torch.manual_seed(tokens)
    logits = torch.randn(tokens, experts) * 3  # float32: ties have probability ~0
    expected_weights, expected_ids = routing.select(logits, torch.float32)  # CPU: the torch path
    normalized = normalize and top_k > 1
    weights, ids = select_greedy(logits.to(DEVICE), top_k, normalized, not normalized or scale_when_normalized,
                                 scaling, torch.float32)
    assert ids.dtype == torch.int64 and weights.shape == (tokens, top_k)
    assert torch.equal(ids.cpu(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=1e-5, atol=1e-7)


def test_equal_scores_pick_the_lowest_expert_first_and_cast_to_the_dtype():
    from afd.kernels.routing import select_greedy

    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, ids = select_greedy(logits.to(DEVICE), 2, False, False, 1.0, torch.bfloat16)
    assert ids.cpu().tolist() == [[1, 2], [0, 1]]
    assert weights.dtype == torch.bfloat16
    torch.testing.assert_close(weights.float().cpu()[1], torch.full((2,), 0.2), rtol=1e-2, atol=0)


def test_nan_logits_give_distinct_valid_experts_and_nan_weights():
    """A NaN in the hidden states must not become an expert id past the table (an out-of-bounds read later)."""
    from afd.kernels.routing import select_greedy

    logits = torch.randn(3, 10)
    logits[0, 4] = float("nan")
    logits[1] = float("nan")
    weights, ids = select_greedy(logits.to(DEVICE), 4, True, True, 1.0, torch.float32)
    ids = ids.cpu()
    assert bool(((ids >= 0) & (ids < 10)).all()) and all(len(set(row)) == 4 for row in ids.tolist())
    assert bool(weights.cpu()[:2].isnan().all()) and not bool(weights.cpu()[2].isnan().any())


def test_too_many_experts_are_refused():
    from afd.kernels.routing import select_greedy

    with pytest.raises(ValueError, match="up to 512 experts"):
        select_greedy(torch.zeros(2, 513, device=DEVICE), 2, False, False, 1.0, torch.float32)
