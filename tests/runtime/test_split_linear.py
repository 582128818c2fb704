"""The float32 router on bf16 tensor cores: three bf16 parts that sum to the weight exactly."""

import pytest
import torch
import torch.nn.functional as F

from afd.kernels.split_linear import bf16_parts, linear_fp32
from afd.models.layers import Router


def weight(rows=64, cols=512, seed=0):
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=generator) * 0.02
    w[0, :4] = torch.tensor([1e-30, -3.0e7, 1.0 + 2**-23, -(2**-126)])  # tiny, huge, last-bit and subnormal-edge
    return w


def test_the_three_parts_sum_to_the_weight_exactly():
    w = weight()
    high, middle, low = bf16_parts(w).float().view(3, *w.shape)
    assert torch.equal(high + middle + low, w)
    assert (high.abs() >= middle.abs()).all() and (middle.abs() >= low.abs()).all()


def test_linear_equals_the_float32_product_of_bf16_inputs():
    w = weight(cols=2048)
    x = torch.randn(33, 2048).bfloat16()
    got = linear_fp32(x, bf16_parts(w))
    want = (x.double() @ w.double().t()).float()
    assert got.dtype == torch.float32 and got.shape == (33, 64)
    scale = x.double().abs() @ w.double().abs().t()  # the error bound of any summation order scales with it
    assert ((got.double() - want.double()).abs() / scale).max() < 1e-6


def test_a_split_router_keeps_float32_logits_and_leaves_other_inputs_alone():
    router = Router(512, 64, fp32_logits=True)
    with torch.no_grad():
        router.weight.copy_(weight())
    x = torch.randn(5, 512)
    before = router(x)
    router.split_weight()
    assert router.weight_parts.dtype == torch.bfloat16 and router.weight_parts.shape == (192, 512)
    assert torch.equal(router(x), before)  # float32 input: the float32 GEMM, as before
    xb = x.bfloat16()
    torch.testing.assert_close(router(xb), F.linear(xb.float(), router.weight), rtol=1e-5, atol=1e-6)


def test_a_bf16_router_is_never_split():
    router = Router(512, 64, fp32_logits=False)
    router.split_weight()
    assert router.weight_parts is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 300, 4096])
def test_on_the_gpu_the_split_router_picks_the_experts_the_float32_one_does(tokens):
    from afd.models.layers import Routing

    torch.manual_seed(tokens)
    w = (torch.randn(64, 2048) * 0.02).cuda()
    x = torch.randn(tokens, 2048, device="cuda").bfloat16()
    got = linear_fp32(x, bf16_parts(w))
    want = (x.double() @ w.double().t())
    scale = x.double().abs() @ w.double().abs().t()
    error = ((got.double() - want).abs() / scale).max().item()
    float32_error = ((F.linear(x.float(), w).double() - want).abs() / scale).max().item()  # the GEMM it replaces
    assert error < max(4 * float32_error, 1e-6), (error, float32_error)
    routing = Routing(top_k=6, num_experts=64, norm_topk_prob=False)
    _, ids = routing.select(got, torch.bfloat16)
    _, want_ids = routing.select(want.float(), torch.bfloat16)
    assert (ids == want_ids).float().mean() > 0.999  # only exact near-ties may differ
