"""What this GPU's torch offers for FP8 block-scaled GEMMs: torch._scaled_mm with 1x128 activation and 128x128
weight scales (checked against the dequantized product, timed against the Triton kernel of afd.kernels.fp8_gemm).

    python3 bench/kernels/fp8_probe.py      # prints one line per shape, writes $OUT/fp8_probe.json
"""

from __future__ import annotations

import sys
import torch
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import require_cuda, time_graph, write_json  # noqa: E402

from afd.kernels import fp8_gemm  # noqa: E402
from afd.kernels.fp8_blocks import dequantize_block_fp8, quantize_block_fp8  # noqa: E402

SHAPES = [(rows, n, k) for rows in (7, 64, 4096) for n, k in ((2048, 7168), (7168, 2048))]


def main() -> None:
    require_cuda(__file__)
    print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(),
          torch.cuda.get_device_capability())
    rows_out = []
    for rows, n, k in SHAPES:
        w, s = quantize_block_fp8(torch.randn(n, k, device="cuda") * 0.02)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        reference = x.float() @ dequantize_block_fp8(w, s).T
        row = {"rows": rows, "n": n, "k": k}
        x_q, x_s = fp8_gemm.per_token_group_quant(x)
        row["triton_ms"] = time_graph(lambda: fp8_gemm.fp8_gemm_triton(x_q, x_s, w, s, None, torch.bfloat16))
        row["quant_ms"] = time_graph(lambda: fp8_gemm.per_token_group_quant(x, column_major_scales=True))
        row["triton_err"] = float((fp8_gemm.fp8_gemm_triton(x_q, x_s, w, s, None, torch.bfloat16).float()
                                   - reference).norm() / reference.norm())
        try:
            xq_c, xs_c = fp8_gemm.per_token_group_quant(x, column_major_scales=True)
            out = torch._scaled_mm(xq_c, w.t(), scale_a=xs_c, scale_b=s.t(), out_dtype=torch.bfloat16)
            row["scaled_mm_err"] = float((out.float() - reference).norm() / reference.norm())
            row["scaled_mm_ms"] = time_graph(lambda: torch._scaled_mm(xq_c, w.t(), scale_a=xs_c, scale_b=s.t(),
                                                                      out_dtype=torch.bfloat16))
        except Exception as err:  # noqa: BLE001 - the probe reports what this torch refuses
            row["scaled_mm_error"] = f"{type(err).__name__}: {str(err)[:200]}"
        rows_out.append(row)
        print(row, flush=True)
    write_json("fp8_probe", {"torch": torch.__version__, "rows": rows_out})


if __name__ == "__main__":
    main()
