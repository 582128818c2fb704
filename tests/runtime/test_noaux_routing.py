"""DeepSeek-V3's noaux_tc router (Routing.noaux_tc, the GPU kernel's reference) equals transformers' router."""

import pytest
import torch

from afd.models.layers import Routing


def hf_router(experts, groups, topk_groups, top_k, normalize, factor):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=experts, n_group=groups, topk_group=topk_groups,
                              num_experts_per_tok=top_k, norm_topk_prob=normalize, routed_scaling_factor=factor)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.3)
    return router


@pytest.mark.parametrize("experts, groups, topk_groups, top_k, normalize, factor",
                         [(16, 4, 2, 4, True, 2.5), (32, 8, 4, 8, True, 2.5), (12, 1, 1, 3, False, 1.0),
                          (8, 4, 1, 2, True, 1.0)])
def test_noaux_tc_equals_transformers(experts, groups, topk_groups, top_k, normalize, factor):
    torch.manual_seed(experts + top_k)
    router = hf_router(experts, groups, topk_groups, top_k, normalize, factor)
    x = torch.randn(64, 32)
    logits, hf_weights, hf_ids = router(x)
    routing = Routing(top_k, experts, normalize, factor, "noaux_tc", groups, topk_groups, scale_when_normalized=True)
    weights, ids = routing.select(logits, torch.float32, router.e_score_correction_bias)
    order, hf_order = ids.sort(dim=-1), hf_ids.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    assert torch.allclose(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices), rtol=1e-6, atol=0)


def test_the_correction_bias_chooses_but_does_not_weigh():
    routing = Routing(2, 4, False, 1.0, "noaux_tc")
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    _, plain = routing.select(logits, torch.float32)
    weights, ids = routing.select(logits, torch.float32, torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert sorted(plain[0].tolist()) == [0, 1] and sorted(ids[0].tolist()) == [0, 3]
    assert torch.allclose(weights[0][ids[0] == 3], torch.sigmoid(torch.tensor(-1.0)))


def test_group_limit_keeps_experts_of_the_best_groups_only():
    """Expert 7 scores best alone, but its group's two best sum lower than groups 0 and 1's."""
    routing = Routing(3, 8, True, 1.0, "noaux_tc", num_groups=4, topk_groups=2)
    logits = torch.tensor([[3.0, 3.0, 2.0, 2.0, -9.0, -9.0, -9.0, 4.0]])
    _, ids = routing.select(logits, torch.float32)
    assert set(ids[0].tolist()) <= {0, 1, 2, 3} and 7 not in ids[0].tolist()
