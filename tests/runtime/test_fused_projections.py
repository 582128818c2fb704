"""The attention's input projections in one GEMM (issue 33): `fuse_linears` makes the Linears' weights views of
one weight; `fused_linear` uses it only while they still are; the projections equal the separate ones."""

import pytest
import torch
from torch import nn

from afd.models.fp8 import Fp8Linear
from afd.models.layers import fuse_linears, fused_linear
from afd.models.loader import load_model


def test_fused_linears_compute_each_projection_and_share_one_weight():
    torch.manual_seed(0)
    linears = [nn.Linear(16, n, bias=False) for n in (12, 4, 4)]
    x = torch.randn(3, 16)
    want = [linear(x) for linear in linears]
    fused = fuse_linears(*linears)
    assert fused.shape == (20, 16)
    assert [linear.weight.data_ptr() for linear in linears] == [fused[i].data_ptr() for i in (0, 12, 16)]
    got = fused_linear(x, fused, *linears)
    assert len(got) == 3 and all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))


def test_a_weight_replaced_after_fusing_is_used_not_the_stale_fused_one():
    """A reload or move leaves the Linear a weight of its own: the fused weight must not be read any more."""
    torch.manual_seed(1)
    linears = [nn.Linear(16, n, bias=False) for n in (8, 8)]
    fused = fuse_linears(*linears)
    linears[1].weight.data = linears[1].weight.data.clone() + 1
    x = torch.randn(2, 16)
    got = fused_linear(x, fused, *linears)
    torch.testing.assert_close(got[1], linears[1](x))


def test_biased_or_fp8_projections_are_not_fused():
    plain = nn.Linear(16, 8, bias=False)
    assert fuse_linears(plain, nn.Linear(16, 8, bias=True)) is None
    assert fuse_linears(plain, Fp8Linear(128, 128)) is None
    assert fuse_linears(plain, nn.Linear(32, 8, bias=False)) is None  # another input width
    assert plain.weight.is_contiguous() and plain.weight.shape == (8, 16)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v2_full", "qwen3_moe"])
def test_fused_input_projections_equal_the_separate_ones(arch, checkpoints):
    model = load_model(str(checkpoints[arch]), "monolithic").model
    attn = model.layers[0].self_attn
    torch.manual_seed(2)
    x = torch.randn(5, model.spec.hidden_size)
    positions = torch.tensor([0, 1, 2, 9, 4])
    with torch.no_grad():
        want = attn.project(x, positions)
        attn.fuse_projections()
        fused = attn.qkv_weight if arch == "qwen3_moe" else attn.in_weight
        assert fused is not None
        got = attn.project(x, positions)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
