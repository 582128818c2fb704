"""Does programmatic dependent launch (PDL) take the fixed cost off a chain of one-token GEMMs? (issue 33, batch 1)

    python3 bench/kernels/pdl_chain.py [--n 2048] [--k 2048] [--chain 64] [--split-k 8]

At batch 1 the decode step is a chain of small kernels, each reading its weight once: a 2048 x 2048 bf16
projection moves 8 MiB (~2 µs at the H200's copy rate) but takes ~6 µs in a graph (session 42's skinny tables),
the rest being launch, ramp-up and drain. With PDL a kernel is launched while the one before it runs; it can
read its weights (which nothing before it writes) before `gdc_wait`, and wait only for its input vector. Here
a chain of `--chain` GEMVs y_i = W_i x_{i-1} (distinct weights, more than L2 holds), each a split-K Triton kernel
adding float32 partials into a zeroed output, captured in one CUDA graph, four ways:
  cublas      torch.mv per link (what bf16 projections run today), bf16 out
  plain       the Triton kernel, normal launches
  pdl_wait    launched with PDL, gdc_wait first (only the launch overlaps)
  pdl_release launched with PDL, gdc_wait first, then the next kernel released at once (what `afd.kernels.pdl`
              does to the decode path's Triton kernels)
  pdl_early   launched with PDL, its weight slice loaded before gdc_wait, dependents released at once
Prints µs per link, the byte floor per link (weight bytes / the measured copy rate) and the ratio; checks
each chain's last vector against torch's. Writes $OUT/pdl_chain.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import ceilings, require_cuda, write_json  # noqa: E402


def build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(w_ptr, x_ptr, y_ptr, n, k, BLOCK_N: tl.constexpr, SLICE_K: tl.constexpr, MODE: tl.constexpr):
        """y[n-block] += W[n-block, k-slice] . x[k-slice] in float32 (MODE 0 plain, 1 wait first, 2 weights first,
        3 wait first and release the next kernel)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * SLICE_K + tl.arange(0, SLICE_K)
        if MODE == 1 or MODE == 3:
            tl.extra.cuda.gdc_wait()
        if MODE == 3:
            tl.extra.cuda.gdc_launch_dependents()
        w = tl.load(w_ptr + rows[:, None] * k + cols[None, :], mask=(rows < n)[:, None])
        if MODE == 2:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()  # the input vector is the kernel before's output
        x = tl.load(x_ptr + cols).to(tl.float32)
        tl.atomic_add(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1), mask=rows < n, sem="relaxed")

    return gemv_kernel


def graph_time_us(run, reps: int = 50) -> float:
    """Median µs of one replay of a graph of `run`."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--chain", type=int, default=64)
    parser.add_argument("--split-k", type=int, default=8)
    parser.add_argument("--block-n", type=int, default=16)
    args = parser.parse_args()
    require_cuda(__file__)
    if args.n != args.k:
        parser.error("a chain needs square weights (--n == --k)")
    kernel = build_kernel()
    torch.manual_seed(0)
    weights = [torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16) / args.k**0.5 for _ in range(args.chain)]
    x0 = torch.randn(args.k, device="cuda", dtype=torch.bfloat16)
    outs = torch.zeros(args.chain, args.n, device="cuda", dtype=torch.float32)
    slice_k = args.k // args.split_k
    grid = (-(-args.n // args.block_n), args.split_k)

    def triton_chain(mode: int):
        def run():
            outs.zero_()
            x = x0
            for i, w in enumerate(weights):
                kernel[grid](w, x, outs[i], args.n, args.k, BLOCK_N=args.block_n, SLICE_K=slice_k, MODE=mode,
                             num_warps=4, **({"launch_pdl": True} if mode else {}))
                x = outs[i]
        return run

    def cublas_chain():
        x = x0
        for w in weights:
            x = torch.mv(w, x)
        return x

    with torch.no_grad():
        want = x0.float()
        for w in weights:
            want = w.float() @ want
        rate = ceilings()["copy_bytes_per_s"]
        floor_us = 2 * args.n * args.k / rate * 1e6
        rows = {"cublas": graph_time_us(cublas_chain)}
        for name, mode in (("plain", 0), ("pdl_wait", 1), ("pdl_release", 3), ("pdl_early", 2)):
            rows[name] = graph_time_us(triton_chain(mode))
            triton_chain(mode)()
            torch.cuda.synchronize()
            error = ((outs[-1] - want).norm() / want.norm()).item()
            rows[f"{name}_rel_error"] = error
    print(f"{torch.cuda.get_device_name()}: {args.chain} links of {args.n}x{args.k} bf16, floor {floor_us:.2f} µs a link")
    result = {"n": args.n, "k": args.k, "chain": args.chain, "split_k": args.split_k, "floor_us": floor_us}
    for name in ("cublas", "plain", "pdl_wait", "pdl_release", "pdl_early"):
        per = rows[name] / args.chain
        note = f"  rel error {rows[name + '_rel_error']:.1e}" if name != "cublas" else ""
        print(f"  {name:10} {per:7.2f} µs a link  {per / floor_us:5.2f}x floor{note}")
        result[name] = {"us_per_link": per, "ratio": per / floor_us, "rel_error": rows.get(name + "_rel_error")}
    write_json("pdl_chain", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
