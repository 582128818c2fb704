"""Is torch's bf16 GEMM (cuBLAS) batch-invariant at DeepSeek-V3's shapes? (issue 32: the bf16 V3 2A1F mismatch)

    python3 bench/kernels/gemm_invariance.py [--rows 1,2,4,8,16,32,64,128,192] [--full 256] [--time-rows 1,8,64,256]

AFD over NCCL equals the monolith only where each row's product does not depend on how many rows share the GEMM: an
attention rank of a 2A1F deployment multiplies its own prompts' and decodes' rows, the monolith all of them. cuBLAS
rounds rows of 1-128 apart from rows of 256 at several projections (an H100, session 45), and the bf16 V3-shaped
2A1F test parts from the monolith in default mode and equals it in batch-invariant mode (session 46). Here, per
projection of a DeepSeek-V3 layer, x[:M] @ Wᵀ against the first M rows of a `--full`-row product, for each M of
`--rows` (prompt steps are padded to token buckets of 16..2048): "=" where equal, else the largest difference; for
torch's GEMM (cuBLAS) and for batch-invariant mode's one-tiling kernel (`afd.kernels.batch_invariant`,
AFD_BATCH_INVARIANT=1), then both kernels' median times at each M of `--time-rows` (the mode's cost). Writes
$OUT/gemm_invariance.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import require_cuda, time_callable, write_json  # noqa: E402

V3_PROJECTIONS = {  # name: (K, N) of x [M, K] @ W [N, K]ᵀ
    "q_a_proj + kv_a_proj": (7168, 1536 + 576), "q_b_proj": (1536, 24576), "kv_b_proj": (512, 32768),
    "o_proj": (16384, 7168), "dense gate_up": (7168, 2 * 18432), "dense down": (18432, 7168),
    "shared gate_up": (7168, 2 * 2048), "shared down": (2048, 7168), "router": (7168, 256), "lm_head": (7168, 129280),
}


def operands(k: int, n: int, full: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(n, k, generator=generator, device="cuda") / k ** 0.5).bfloat16()
    return torch.randn(full, k, generator=generator, device="cuda").bfloat16(), w


def compare(product, x: torch.Tensor, w: torch.Tensor, rows: list[int]) -> list[float]:
    """For each M in `rows`: 0.0 where product(x[:M], Wᵀ) equals the full product's first M rows, else the largest
    absolute difference."""
    whole = product(x, w.T)
    return [(product(x[:m], w.T) - whole[:m]).float().abs().max().item() for m in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,192")
    parser.add_argument("--full", type=int, default=256)
    parser.add_argument("--time-rows", default="1,8,64,256", help="M at which both kernels are timed ('' : none)")
    args = parser.parse_args()
    require_cuda(__file__)
    from afd.kernels.batch_invariant import matmul  # local import: Triton, after the CUDA check

    rows = [int(m) for m in args.rows.split(",")]
    time_rows = [int(m) for m in args.time_rows.split(",") if m]
    if not rows or min(rows) < 1 or max(rows) > args.full or any(not 1 <= m <= args.full for m in time_rows):
        raise SystemExit(f"--rows {args.rows} and --time-rows {args.time_rows}: each must be 1..--full ({args.full})")
    products = {"cublas": torch.matmul, "invariant": matmul}
    generator = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: rows M of x[:M] @ Wᵀ against the first M of {args.full} rows")
    print(f"{'projection':<22} {'kernel':<9} {'K':>6} {'N':>7}  " + " ".join(f"{m:>6}" for m in rows)
          + "  " + " ".join(f"{f'ms@{m}':>13}" for m in time_rows))
    results = {}
    for name, (k, n) in V3_PROJECTIONS.items():
        x, w = operands(k, n, args.full, generator)
        results[name] = {"k": k, "n": n}
        times = {kernel: [time_callable(lambda: product(x[:m], w.T), 20) for m in time_rows]
                 for kernel, product in products.items()}
        for kernel, product in products.items():
            diffs = compare(product, x, w, rows)
            results[name][kernel] = {"max_abs_diff": dict(zip(map(str, rows), diffs)),
                                     "ms": dict(zip(map(str, time_rows), times[kernel]))}
            ratios = [f"{t:.4f}" + (f" ({t / c:.1f}x)" if kernel == "invariant" else "      ")
                      for t, c in zip(times[kernel], times["cublas"])]
            print(f"{name:<22} {kernel:<9} {k:>6} {n:>7}  "
                  + " ".join(f"{'=' if d == 0 else f'{d:.0e}':>6}" for d in diffs) + "  "
                  + " ".join(f"{r:>13}" for r in ratios), flush=True)
    write_json("gemm_invariance", {"device": torch.cuda.get_device_name(), "full": args.full, "rows": rows,
                                   "time_rows": time_rows, "projections": results})


if __name__ == "__main__":
    main()
