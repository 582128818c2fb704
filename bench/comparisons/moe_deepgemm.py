"""Our MoE GEMM kernels against DeepGEMM's m-grouped contiguous GEMMs (what SGLang and vLLM run for FP8 block-scaled
MoE on Hopper), same shapes, same balanced routing, same GPU.

    python3 bench/comparisons/moe_deepgemm.py                          # FP8 DeepSeek-V3 and Qwen3-30B-A3B, bf16 both sample shapes
    python3 bench/comparisons/moe_deepgemm.py --formats fp8 --tokens 4096

Needs a `deep_gemm` built against the torch at hand (PyPI's `sgl-deep-gemm` 0.2.5 is built against another torch:
its `_C.so` does not load under torch 2.11); `bench/comparisons/deepgemm_build.sh` packs the sources here and builds them on the
device. What session 48 built on the device image (not in this repository):
deepseek-ai/DeepGEMM 54e2261 (2.6.1) with NVIDIA/cutlass f3fde58 and fmtlib/fmt 553ec11 as its third-party
directories, `cute` and `cutlass` copied into `deep_gemm/include`, then
`CC=/usr/bin/g++-13 CXX=/usr/bin/g++-13 LDSHARED="/usr/bin/g++-13 -shared" python3 setup.py build_ext --inplace`
and `PYTHONPATH=<that directory>`. The image's default `/opt/gcc/bin/g++` links libstdc++ statically into `_C.so`,
and that copy crashed (std::regex, then an ostream) at the first JIT compile, beside the libstdc++ torch loads.

Rows: each expert's rows padded to DeepGEMM's alignment (128), in our `moe_align` layout; padding rows marked -1 so
DeepGEMM skips their blocks. DeepGEMM's gate_up and down are timed alone (CUDA-graph medians, its per-call scale
layout transform included); ours are the layer's `gate_up_kernel` and `down_kernel` from the profiler (one run of
the table's settings), beside the whole layer's graph median. `rel diff` compares the two layers' outputs (DeepGEMM's
GEMMs write bf16, ours keep float32 to the epilogue; the FP8 activations are quantized from those).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import count_kernels, require_cuda, time_graph, write_json  # noqa: E402
from bench.harness.shapes import MOE_SHAPES  # noqa: E402

from afd.kernels import fp8_gemm, moe_align  # noqa: E402
from afd.kernels.moe import experts_triton  # noqa: E402


def balanced_routing(tokens: int, routed: int, top_k: int, seed: int = 3):
    """Uniformly random distinct experts per token (a trained router's balanced load) and random weights."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(tokens, routed, device="cuda", generator=generator).topk(top_k, dim=1).indices.int()
    return torch.rand(tokens, top_k, device="cuda", generator=generator).to(torch.bfloat16), ids


class DeepGemmLayer:
    """The experts through DeepGEMM's two grouped GEMMs, with torch glue around them (gather, SiLU·up, FP8
    quantization, the weighted sum): a correctness reference for the comparison, not a fast path."""

    def __init__(self, dg, x, ids, gate_up, down, shared: int, gate_up_scale=None, down_scale=None):
        self.dg, self.gate_up, self.down = dg, gate_up, down
        self.gate_up_scale, self.down_scale = gate_up_scale, down_scale
        num_experts, self.hidden, self.inter = down.shape
        tokens, top_k = ids.shape
        slots = top_k + shared
        num_pairs = tokens * slots
        layout = moe_align.align(ids, shared, num_experts, dg.get_mk_alignment_for_contiguous_layout())
        valid = layout.pairs < num_pairs
        self.token_of_row = torch.where(valid, layout.pairs // slots, 0).long()
        block = layout.pairs.shape[0] // layout.tile_expert.shape[0]
        self.expert_of_row = torch.where(valid, layout.tile_expert.repeat_interleave(block), -1).int()
        row_of_pair = torch.zeros(num_pairs + 1, dtype=torch.long, device=x.device)  # padding rows land on the last
        row_of_pair[layout.pairs.long()] = torch.arange(layout.pairs.shape[0], device=x.device)
        self.row_of_pair, self.slots, self.top_k = row_of_pair[:num_pairs], slots, top_k
        self.rows = layout.pairs.shape[0]
        # the two GEMMs' outputs ([rows, 2I], [rows, H], bf16: what DeepGEMM writes), shared by __call__ and gemms
        self.first = torch.empty(self.rows, 2 * self.inter, dtype=torch.bfloat16, device=x.device)
        self.second = torch.empty(self.rows, self.hidden, dtype=torch.bfloat16, device=x.device)

    def _grouped(self, a, a_scale, w, w_scale, out):
        if w_scale is None:
            self.dg.m_grouped_bf16_gemm_nt_contiguous(a, w, out, self.expert_of_row)
        else:
            self.dg.m_grouped_fp8_gemm_nt_contiguous((a, a_scale), (w, w_scale), out, self.expert_of_row)

    def gemms(self, x):
        """(gate_up, down) closures over fixed operands, for timing the GEMMs alone."""
        a, a_scale = self._rows(x)
        act, act_scale = self._down_operand(torch.randn(self.rows, self.inter, device=x.device, dtype=torch.bfloat16))
        return (lambda: self._grouped(a, a_scale, self.gate_up, self.gate_up_scale, self.first),
                lambda: self._grouped(act, act_scale, self.down, self.down_scale, self.second))

    def _down_operand(self, act):
        """(down's A, its scales): `act` (bf16), quantized per 128 columns for FP8 experts."""
        return fp8_gemm.per_token_group_quant(act) if self.down_scale is not None else (act, None)

    def _rows(self, x):
        if self.gate_up_scale is None:
            return x[self.token_of_row], None
        x_q, x_scale = fp8_gemm.per_token_group_quant(x)
        return x_q[self.token_of_row], x_scale[self.token_of_row].contiguous()

    def __call__(self, x, weights):
        first, second = self.first, self.second
        self._grouped(*self._rows(x), self.gate_up, self.gate_up_scale, first)
        act = torch.nn.functional.silu(first[:, :self.inter].float()) * first[:, self.inter:].float()
        self._grouped(*self._down_operand(act.bfloat16()), self.down, self.down_scale, second)
        per_slot = second[self.row_of_pair].view(x.shape[0], self.slots, self.hidden).float()
        routed = (per_slot[:, :self.top_k] * weights[..., None].float()).bfloat16().float().sum(1)
        return (routed + per_slot[:, self.top_k:].sum(1)).to(x.dtype)


def experts(shape: dict, fp8: bool):
    """(gate_up, down, gate_up_scale, down_scale): random routed + shared experts, FP8 with block scales or bf16."""
    if fp8:
        from bench.kernels.moe_layer_fp8 import quantized_experts

        q = quantized_experts(shape)
        return q["gate_up"], q["down"], q["gate_up_scale"], q["down_scale"]
    count, hidden, inter = shape["routed"] + shape["shared"], shape["hidden"], shape["inter"]
    generator = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(count, 2 * inter, hidden, device="cuda", generator=generator, dtype=torch.bfloat16) * 0.02
    down = torch.randn(count, hidden, inter, device="cuda", generator=generator, dtype=torch.bfloat16) * 0.02
    return gate_up, down, None, None


def kernel_us(run, name: str) -> float:
    """Device µs of the kernels whose name starts with `name` in one profiled `run()`."""
    return sum(us for kernel, us in count_kernels(run)["us_by_name"].items() if kernel.startswith(name))


def compare(dg, shape_name: str, fp8: bool, token_counts) -> list[dict]:
    shape = MOE_SHAPES[shape_name]
    routed, shared, top_k, hidden = (shape[key] for key in ("routed", "shared", "top_k", "hidden"))
    gate_up, down, gate_up_scale, down_scale = experts(shape, fp8)
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = balanced_routing(tokens, routed, top_k)
        with torch.inference_mode():
            ours = lambda: experts_triton(x, weights, ids, gate_up, down, shared, None,  # noqa: E731
                                          gate_up_scale, down_scale)
            theirs = DeepGemmLayer(dg, x, ids, gate_up, down, shared, gate_up_scale, down_scale)
            reference = ours().float()
            diff = float((theirs(x, weights).float() - reference).norm() / reference.norm())
            dg_gate_up, dg_down = (time_graph(f) for f in theirs.gemms(x))
            ours()
            row = {"shape": shape_name, "format": "fp8" if fp8 else "bf16", "tokens": tokens,
                   "ours_layer_ms": time_graph(ours), "ours_gate_up_ms": kernel_us(ours, "gate_up_kernel") / 1e3,
                   "ours_down_ms": kernel_us(ours, "down_kernel") / 1e3, "deepgemm_gate_up_ms": dg_gate_up,
                   "deepgemm_down_ms": dg_down, "rel_diff": diff}
        ours_sum = row["ours_gate_up_ms"] + row["ours_down_ms"]
        row["deepgemm_over_ours"] = (dg_gate_up + dg_down) / ours_sum
        print(f"{shape_name} {row['format']} {tokens:>5} tokens: ours gate_up {row['ours_gate_up_ms']:.3f} + down "
              f"{row['ours_down_ms']:.3f} ms (layer {row['ours_layer_ms']:.3f}); DeepGEMM {dg_gate_up:.3f} + "
              f"{dg_down:.3f} ms; DeepGEMM / ours {row['deepgemm_over_ours']:.2f}; rel diff {diff:.1e}", flush=True)
        rows.append(row)
    del gate_up, down, gate_up_scale, down_scale
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="fp8,bf16", help="fp8 (DeepSeek-V3, Qwen3), bf16 (Qwen3, V2-Lite)")
    parser.add_argument("--tokens", default="1024,4096")
    args = parser.parse_args()
    require_cuda(__file__)
    try:
        import deep_gemm
    except ImportError as error:
        raise SystemExit(f"bench/comparisons/moe_deepgemm.py needs DeepGEMM built against torch {torch.__version__} ({error}); "
                         "its docstring says how session 48 built it") from error
    token_counts = [int(t) for t in args.tokens.split(",")]
    plan = {"fp8": (("deepseek-v3", True), ("qwen3-30b-a3b", True)),
            "bf16": (("qwen3-30b-a3b", False), ("deepseek-v2-lite", False))}
    rows = [row for fmt in args.formats.split(",") for shape, fp8 in plan[fmt]
            for row in compare(deep_gemm, shape, fp8, token_counts)]
    write_json("moe_deepgemm", {"deep_gemm": getattr(deep_gemm, "__version__", "?"),
                                "device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
