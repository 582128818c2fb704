"""The one-kernel greedy routing equals `Routing.select`'s torch path.

Runs on a GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1 before Triton is imported,
Triton 3.7+); otherwise skips, as the Triton MoE settings tests do.
"""

import pytest
import torch

from tests.kernel_device import NO_KERNEL_DEVICE, kernel_device

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason=NO_KERNEL_DEVICE)

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


NOAUX_CASES = {  # id → (experts, top_k, groups, groups kept, norm_topk_prob, scaling_factor, with a bias)
    "deepseek-v3": (256, 8, 8, 4, True, 2.5, True),
    "small-groups-of-two": (16, 3, 8, 3, True, 1.0, True),
    "one-group-not-normalized": (64, 6, 1, 1, False, 16.0, True),
    "kimi-k2-no-groups": (384, 8, 1, 1, True, 2.827, True),
    "no-bias": (32, 4, 4, 2, True, 1.0, False),
    "top-1": (8, 1, 2, 1, True, 1.0, True),
}


@pytest.mark.parametrize("tokens", [1, 37, 300])
@pytest.mark.parametrize("case", sorted(NOAUX_CASES))
def test_select_noaux_tc_equals_the_torch_routing(case, tokens):
    """DeepSeek-V3's router: sigmoid, the correction bias for choosing only, group-limited top-k."""
    from afd.kernels.routing import select_noaux_tc
    from afd.models.layers import Routing

    experts, top_k, groups, kept, normalize, scaling, with_bias = NOAUX_CASES[case]
    routing = Routing(top_k=top_k, num_experts=experts, norm_topk_prob=normalize, scaling_factor=scaling,
                      topk_method="noaux_tc", num_groups=groups, topk_groups=kept)
    torch.manual_seed(tokens)
    logits = torch.randn(tokens, experts) * 2
    bias = torch.randn(experts) * 0.5 if with_bias else None  # large enough to change choices, some negative
    expected_weights, expected_ids = routing.select(logits, torch.float32, bias)  # CPU: the torch path
    weights, ids = select_noaux_tc(logits.to(DEVICE), bias.to(DEVICE) if with_bias else None, top_k, groups, kept,
                                   normalize, scaling, torch.float32)
    assert ids.dtype == torch.int64 and weights.shape == (tokens, top_k)
    assert torch.equal(ids.cpu(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=1e-5, atol=1e-7)
    if with_bias:  # the bias changes which experts are chosen, never their weights
        unbiased = torch.sigmoid(logits).gather(1, ids.cpu())
        if normalize:
            unbiased = unbiased / unbiased.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.cpu(), unbiased * scaling, rtol=1e-5, atol=1e-7)


def test_noaux_tc_keeps_only_the_best_groups():
    """Group 1 holds the best single expert, but group 0's two best sum higher: group 0 alone is kept."""
    from afd.kernels.routing import select_noaux_tc

    logits = torch.tensor([[2.0, 1.9, -5.0, -5.0, 3.0, -5.0, -5.0, -5.0]])
    weights, ids = select_noaux_tc(logits.to(DEVICE), None, 2, 2, 1, False, 1.0, torch.float32)
    assert ids.cpu().tolist() == [[0, 1]]


def test_noaux_tc_nan_logits_give_distinct_valid_experts():
    from afd.kernels.routing import select_noaux_tc

    logits = torch.randn(2, 16)
    logits[0, 3] = float("nan")
    logits[1] = float("nan")
    weights, ids = select_noaux_tc(logits.to(DEVICE), torch.zeros(16, device=DEVICE), 4, 4, 2, True, 1.0,
                                   torch.float32)
    ids = ids.cpu()
    assert bool(((ids >= 0) & (ids < 16)).all()) and all(len(set(row)) == 4 for row in ids.tolist())


def test_noaux_tc_refuses_groups_of_an_odd_expert_count():
    from afd.kernels.routing import noaux_tc_fits, select_noaux_tc

    assert noaux_tc_fits(256, 8, 8, 4) and noaux_tc_fits(384, 8, 1, 1) and not noaux_tc_fits(96, 8, 3, 2)
    with pytest.raises(ValueError, match="power-of-two"):
        select_noaux_tc(torch.zeros(2, 96, device=DEVICE), None, 8, 3, 2, True, 1.0, torch.float32)


@pytest.mark.parametrize("method", ["greedy", "noaux_tc"])
def test_split_linear_blocks_are_summed_in_the_kernel_as_sum_parts_adds_them(method):
    """DeepSeek's float32 router comes as three GEMM column blocks (split_linear): the kernel adds them itself
    (issue 33, one launch fewer a layer), to the same bits as `sum_parts` then the kernel."""
    from afd.kernels import routing, split_linear

    experts, top_k, tokens = 64, 6, 37
    torch.manual_seed(5)
    weight = torch.randn(experts, 96)
    blocks = split_linear.part_products(torch.randn(tokens, 96).bfloat16(), split_linear.bf16_parts(weight))
    if method == "greedy":
        run = lambda logits, parts: routing.select_greedy(logits.to(DEVICE), top_k, False, True, 1.0,  # noqa: E731
                                                          torch.float32, parts)
    else:
        run = lambda logits, parts: routing.select_noaux_tc(logits.to(DEVICE), None, top_k, 8, 3, True,  # noqa: E731
                                                            2.5, torch.float32, parts)
    weights, ids = run(blocks, 3)
    want_weights, want_ids = run(split_linear.sum_parts(blocks), 1)
    assert torch.equal(ids.cpu(), want_ids.cpu()) and torch.equal(weights.cpu(), want_weights.cpu())


@pytest.mark.parametrize("method", ["greedy", "noaux_tc"])
def test_split_k_partials_are_added_in_the_kernel_as_the_skinny_gemm_adds_them(method):
    """The skinny GEMM's split-K partials of the router's three blocks ([S, T, 3E]) go to the kernel unsummed
    (issue 33: its sum launch gone): the same bits as the partials summed in split order, then the kernel."""
    from afd.kernels import routing
    from afd.kernels.skinny_gemm import sum_partials

    experts, top_k, tokens, splits = 64, 6, 9, 8
    torch.manual_seed(3)
    partials = torch.randn(splits, tokens, 3 * experts) * torch.tensor([1.0, 1e-3, 1e-6]).repeat_interleave(experts)
    if method == "greedy":
        run = lambda logits: routing.select_greedy(logits.to(DEVICE), top_k, False, True, 1.0,  # noqa: E731
                                                   torch.float32, 3)
    else:
        run = lambda logits: routing.select_noaux_tc(logits.to(DEVICE), None, top_k, 8, 3, True,  # noqa: E731
                                                     2.5, torch.float32, 3)
    weights, ids = run(partials)
    want_weights, want_ids = run(sum_partials(partials))
    assert torch.equal(ids.cpu(), want_ids.cpu()) and torch.equal(weights.cpu(), want_weights.cpu())
    with pytest.raises(ValueError, match="partials"):
        run(partials[None])


def test_the_torch_routing_adds_split_k_partials_first():
    """Where the routing kernel does not run, `Routing.select` adds [S, T, E] partials itself, in split order."""
    from afd.kernels.skinny_gemm import sum_partials
    from afd.models.layers import Routing

    torch.manual_seed(4)
    partials = torch.randn(4, 5, 32)
    route = Routing(top_k=3, num_experts=32)
    got = route.select(partials, torch.float32)
    want = route.select(sum_partials(partials), torch.float32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_moe_layer_routes_raw_router_output_as_the_shipped_logits_route():
    """`MoE.forward` hands `Router.raw`'s output to the routing (split_linear's blocks where it has them): the same
    weights and experts, bit for bit, as the float32 logits an attention rank ships (`Router.forward`)."""
    from afd.models.layers import MoE, Routing

    torch.manual_seed(7)
    for fp32_logits in (True, False):
        moe = MoE(96, Routing(top_k=6, num_experts=64), 32, 0, fp32_logits).to(DEVICE)
        moe.gate.weight.data.normal_()
        x = torch.randn(5, 96, device=DEVICE).to(torch.bfloat16 if DEVICE == "cuda" else torch.float16)
        if fp32_logits:
            moe.gate.split_weight()
        else:  # the checkpoint's dtype, as the loader leaves a 16-bit gate
            moe.gate.to(x.dtype)
        raw, parts = moe.gate.raw(x)
        assert parts == (3 if fp32_logits and DEVICE == "cuda" else 1)
        got = moe.routing.select(raw, x.dtype, None, parts)
        want = moe.routing.select(moe.gate(x), x.dtype, None)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
