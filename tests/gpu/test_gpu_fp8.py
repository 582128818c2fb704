"""FP8 on the GPU at the real models' shapes: the dense GEMM both ways, in CUDA graphs, and every entry of the
shipped FP8 MoE tables against the dequantized experts. Skips without CUDA."""

import json
import re

import pytest
import torch

from afd.kernels.fp8_blocks import dequantize_block_fp8, quantize_block_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# activations quantized to e4m3 (3 mantissa bits) cost ~2-3% of a product's norm; a wrong scale ~100%
TOLERANCE = 0.05


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.double() - reference.double()).norm() / reference.double().norm())


@pytest.mark.parametrize("choice", ["scaled_mm", "triton"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("out_features,in_features", [(2048, 7168), (1536, 7168), (7168, 2048)])
def test_fp8_linear_equals_the_dequantized_linear(choice, rows, out_features, in_features, monkeypatch):
    from afd.kernels import fp8_gemm

    monkeypatch.setenv("AFD_FP8_GEMM", choice)
    torch.manual_seed(rows)
    weight, scale_inv = quantize_block_fp8(torch.randn(out_features, in_features, device="cuda") * 0.02)
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    reference = x.float() @ dequantize_block_fp8(weight, scale_inv).T
    out = fp8_gemm.fp8_linear(x, weight, scale_inv)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    assert relative_error(out, reference) < TOLERANCE


def test_fp8_linear_auto_takes_triton_where_scaled_mm_does_not_fit(monkeypatch):
    """576 output features (DeepSeek's kv_a_proj): not a multiple of 128, so auto runs the Triton kernel."""
    from afd.kernels import fp8_gemm

    monkeypatch.setenv("AFD_FP8_GEMM", "auto")
    weight, scale_inv = quantize_block_fp8(torch.randn(576, 7168, device="cuda") * 0.02)
    x = torch.randn(3, 7168, device="cuda", dtype=torch.bfloat16)
    assert not fp8_gemm.scaled_mm_fits(x, weight)
    out = fp8_gemm.fp8_linear(x, weight, scale_inv)
    assert relative_error(out, x.float() @ dequantize_block_fp8(weight, scale_inv).T) < TOLERANCE


@pytest.mark.parametrize("choice", ["auto", "triton"])
def test_fp8_linear_and_moe_replay_in_a_cuda_graph(choice, monkeypatch):
    """Captured once, replayed on new inputs: no host synchronisation, results as eager."""
    from afd.kernels import fp8_gemm
    from afd.kernels.moe import experts_cuda

    monkeypatch.setenv("AFD_FP8_GEMM", choice)
    monkeypatch.setenv("AFD_MOE_KERNEL", "triton")
    torch.manual_seed(0)
    weight, scale_inv = quantize_block_fp8(torch.randn(2048, 7168, device="cuda") * 0.02)
    gate_up, gate_up_scale = quantize_block_fp8(torch.randn(9, 2 * 2048, 7168, device="cuda") * 0.02)
    down, down_scale = quantize_block_fp8(torch.randn(9, 7168, 2048, device="cuda") * 0.02)
    x = torch.randn(64, 7168, device="cuda", dtype=torch.bfloat16)
    weights, ids = torch.rand(64, 8, device="cuda").topk(4, dim=-1)
    weights = weights.bfloat16()

    def step():
        return (fp8_gemm.fp8_linear(x, weight, scale_inv),
                experts_cuda(x, weights, ids, gate_up, down, 1, None, gate_up_scale, down_scale))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(torch.randn_like(x))
    ids.copy_(torch.rand(64, 8, device="cuda").topk(4, dim=-1).indices)
    graph.replay()
    eager = step()
    torch.testing.assert_close(captured[0], eager[0], rtol=0, atol=0)
    torch.testing.assert_close(captured[1], eager[1], rtol=1e-2, atol=1e-3)  # pair order inside an expert may vary


def shipped_fp8_tables() -> list:
    from afd.kernels.moe import CONFIG_DIR

    return sorted(CONFIG_DIR.glob("E*_H*_I*_fp8_*.json"))


@pytest.mark.parametrize("path", shipped_fp8_tables(), ids=lambda path: path.stem)
def test_every_entry_of_a_shipped_fp8_table_equals_the_dequantized_experts(path, monkeypatch):
    """Each tuned FP8 setting computes the MoE at its table's shapes and token count (fewer experts: the
    kernels' settings do not depend on their count)."""
    from afd.kernels import moe
    from afd.kernels.moe import experts_cuda

    _, hidden, inter, device = re.fullmatch(r"E(\d+)_H(\d+)_I(\d+)_fp8_(.+)", path.stem).groups()
    if device != torch.cuda.get_device_name().replace(" ", "_"):
        pytest.skip(f"tuned for {device}")
    hidden, inter = int(hidden), int(inter)
    table = {int(tokens): cfg for tokens, cfg in json.loads(path.read_text())["configs"].items()}
    torch.manual_seed(0)
    routed, num_shared, top_k = 16, 1, 8
    gate_up, gate_up_scale = quantize_block_fp8(torch.randn(routed + 1, 2 * inter, hidden, device="cuda") * 0.02)
    down, down_scale = quantize_block_fp8(torch.randn(routed + 1, hidden, inter, device="cuda") * 0.02)
    for tokens, cfg in table.items():
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = torch.rand(tokens, routed, device="cuda").topk(top_k, dim=-1)
        weights = weights.bfloat16()
        monkeypatch.setenv("AFD_MOE_KERNEL", "grouped")  # dequantized weights, torch's grouped GEMM
        reference = experts_cuda(x, weights, ids, gate_up, down, num_shared, None, gate_up_scale, down_scale)
        monkeypatch.setenv("AFD_MOE_KERNEL", "triton")
        monkeypatch.setattr(moe, "device_table", lambda *args, cfg=cfg: {tokens: cfg})
        out = experts_cuda(x, weights, ids, gate_up, down, num_shared, None, gate_up_scale, down_scale)
        assert relative_error(out, reference) < TOLERANCE, tokens
