"""Tune the Triton MoE block sizes per token count at DeepSeek-V2-Lite shapes; write the table.

    python3 bench/moe_tune.py [--tokens 1,16,64] [--workers 12]

Every candidate of each kernel (gate_up, down) is compiled first in parallel worker
processes (Triton's on-disk cache then serves the timing process), then timed alone
as a CUDA-graph replay on the real routing of each token count. Per token count the
block-M with the least gate_up + down time wins, each kernel with its own best
N/K/warps/stages. The table goes to `runtime/afd/kernels/configs/` (read by
`afd.kernels.moe.config_table`) and to $OUT; a table of the winners is printed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch
from common import V2_LITE, time_graph, write_json

TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def block_ms(tokens: int, slots: int, experts: int) -> tuple[int, ...]:
    """Block-M values worth trying for `tokens` (by rows per expert)."""
    per_expert = tokens * slots / experts
    if per_expert <= 8:
        return (16,)
    if per_expert <= 24:
        return (16, 32)
    if per_expert <= 64:
        return (16, 32, 64)
    if per_expert <= 256:
        return (32, 64, 128)
    return (64, 128)


def candidates(block_m: int) -> list[dict]:
    """Kernel settings tried for one block-M: small tiles stream weights, large ones feed the tensor cores."""
    if block_m <= 32:
        space = itertools.product((32, 64, 128), (64, 128, 256), (4,), (3, 4, 5))
    else:
        space = itertools.product((64, 128, 256), (64, 128), (4, 8), (3, 4))
    return [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s) for n, k, w, s in space]


class Problem:
    """One token count's routing and buffers, for timing either kernel under any setting."""

    def __init__(self, gate_up, down, num_shared: int, tokens: int, seed: int = 0):
        from afd.kernels import moe_triton

        self.moe_triton = moe_triton
        self.gate_up, self.down, self.num_shared = gate_up, down, num_shared
        experts, hidden, inter = down.shape
        generator = torch.Generator(device="cuda").manual_seed(seed)
        top_k = V2_LITE["num_experts_per_tok"]
        scores = torch.rand(tokens, experts - num_shared, device="cuda", generator=generator)
        self.weights, self.ids = scores.topk(top_k, dim=-1)
        self.weights = self.weights.to(torch.bfloat16)
        self.x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", generator=generator)
        self.top_k, self.slots = top_k, top_k + num_shared
        self.num_pairs = tokens * self.slots
        self.layouts = {}
        self.inter, self.hidden = inter, hidden

    def layout(self, block_m: int):
        if block_m not in self.layouts:
            pairs, tiles = self.moe_triton.align(self.ids, self.num_shared, self.down.shape[0], block_m)
            act = torch.randn(pairs.shape[0], self.inter, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(self.num_pairs, self.hidden, dtype=torch.bfloat16, device="cuda")
            self.layouts[block_m] = (pairs, tiles, act, out)
        return self.layouts[block_m]

    def launcher(self, kernel: str, block_m: int, cfg: dict):
        pairs, tiles, act, out = self.layout(block_m)
        if kernel == "gate_up":
            return lambda: self.moe_triton.launch_gate_up(
                self.x, self.gate_up, act, pairs, tiles, self.num_pairs, self.slots, block_m, cfg)
        return lambda: self.moe_triton.launch_down(
            act, self.down, out, pairs, tiles, self.weights, self.num_pairs, self.top_k, self.slots, block_m, cfg)


def random_experts(num_shared: int):
    experts = V2_LITE["n_routed_experts"] + num_shared
    hidden, inter = V2_LITE["hidden_size"], V2_LITE["moe_intermediate_size"]
    gate_up = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16, device="cuda") * 0.02
    down = torch.randn(experts, hidden, inter, dtype=torch.bfloat16, device="cuda") * 0.02
    return gate_up, down


def compile_jobs(jobs: list) -> list:
    """Worker: run each (kernel, block_m, cfg, tokens) once so Triton compiles and caches it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    num_shared = V2_LITE["n_shared_experts"]
    gate_up, down = random_experts(num_shared)
    problems, failed = {}, []
    for kernel, block_m, cfg, tokens in jobs:
        problem = problems.setdefault(tokens, Problem(gate_up, down, num_shared, tokens))
        try:
            problem.launcher(kernel, block_m, cfg)()
            torch.cuda.synchronize()
        except Exception as err:  # out of shared memory or registers: not a candidate
            failed.append((kernel, block_m, cfg, type(err).__name__))
    return failed


def precompile(sizes: list[int], slots: int, experts: int, workers: int) -> set:
    """Compile every candidate in parallel; returns the (kernel, block_m, cfg) that failed."""
    jobs = []
    for block_m in sorted({bm for tokens in sizes for bm in block_ms(tokens, slots, experts)}):
        for cfg in candidates(block_m):
            for kernel in ("gate_up", "down"):
                jobs.append((kernel, block_m, cfg, 64))
                if block_m == 16 and 1 in sizes:
                    jobs.append((kernel, block_m, cfg, 1))  # odd pair counts specialise differently
    started = time.monotonic()
    chunks = [jobs[i::workers] for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.map(compile_jobs, chunks)
    failed = {(kernel, bm, json.dumps(cfg, sort_keys=True)) for chunk in results for kernel, bm, cfg, _ in chunk}
    print(f"compiled {len(jobs)} kernel variants in {time.monotonic() - started:.0f} s ({len(failed)} do not fit)", flush=True)
    return failed


def tune(problem: Problem, tokens: int, failed: set) -> dict:
    """The best settings for one token count, with their times."""
    best = None
    experts = problem.down.shape[0]
    for block_m in block_ms(tokens, problem.slots, experts):
        entry = {"BLOCK_M": block_m}
        for kernel in ("gate_up", "down"):
            timed = []
            for cfg in candidates(block_m):
                if (kernel, block_m, json.dumps(cfg, sort_keys=True)) in failed:
                    continue
                timed.append((time_graph(problem.launcher(kernel, block_m, cfg), iters=10), cfg))
            ms, cfg = min(timed, key=lambda pair: pair[0])
            entry[kernel], entry[f"{kernel}_ms"] = cfg, ms
        entry["align_ms"] = time_graph(lambda: problem.moe_triton.align(problem.ids, problem.num_shared, experts, block_m))
        entry["total_ms"] = entry["gate_up_ms"] + entry["down_ms"] + entry["align_ms"]
        if best is None or entry["total_ms"] < best["total_ms"]:
            best = entry
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    args = parser.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    from afd.kernels.moe import CONFIG_DIR, config_name

    num_shared = V2_LITE["n_shared_experts"]
    slots = V2_LITE["num_experts_per_tok"] + num_shared
    gate_up, down = random_experts(num_shared)
    experts, hidden, inter = down.shape
    failed = precompile(sizes, slots, experts, args.workers)
    table, started = {}, time.monotonic()
    for tokens in sizes:
        table[tokens] = tune(Problem(gate_up, down, num_shared, tokens), tokens, failed)
        row = table[tokens]
        print(f"tokens {tokens:>5}: BM {row['BLOCK_M']:>3} gate_up {row['gate_up_ms']:.3f} ms {row['gate_up']} "
              f"down {row['down_ms']:.3f} ms {row['down']} align {row['align_ms']:.3f} ms", flush=True)
    print(f"timed in {time.monotonic() - started:.0f} s")
    device = torch.cuda.get_device_name()
    document = {"device": device, "torch": torch.__version__, "configs": {str(t): row for t, row in table.items()}}
    name = config_name(experts, hidden, inter, device)
    CONFIG_DIR.mkdir(exist_ok=True)
    (CONFIG_DIR / name).write_text(json.dumps(document, indent=1) + "\n")
    write_json("moe_tune", {"file": name, **document})
    print(f"wrote {CONFIG_DIR / name}")


if __name__ == "__main__":
    main()
