"""Tune the Triton MoE block sizes per token count at a sample model's MoE shapes; write the table.

    python3 bench/kernels/moe_tune.py [--shape deepseek-v2-lite|qwen3-30b-a3b] [--tokens 1,16,64] [--workers 12]
    python3 bench/kernels/moe_tune.py --kernels down --tokens 1024,4096   # re-tune one kernel, keep the rest of each row
    python3 bench/kernels/moe_tune.py --fp8 --shape deepseek-v3 --tokens 64,256,1024,4096 --deadline 120   # FP8 experts

Every candidate of each kernel (gate_up, down) is compiled first in parallel worker
processes (Triton's on-disk cache then serves the timing process), then timed alone
as a CUDA-graph replay on the real routing of each token count. Per token count the
layout's block-M with the least gate_up + down time wins, each kernel with its own best
tile height (the layout's or half of it), N/K/warps/stages, TMA loads and a persistent grid (on
Hopper), and gate_up with its rows pre-gathered or not (GATHER: timed with its copy kernel), its gate
and up blocks in one dot or two (ONE_DOT) or, FP8 on tiles of 64+ rows, its column block in two passes of one
dot (HALVES); FP8 TMA tiles also under a register cap (MAX_REGS, `register_caps`). Every candidate is timed in two
program orders, then the three best of each kernel are timed again, longer, under several (GROUP_M; no recompile,
it is a run-time argument). `legacy` times are the best of the old search space
(layout tiles, column-major order, pointer loads, no GATHER, one program per job) on today's code.
The new rows are merged into the table in `runtime/afd/kernels/configs/` (read by
`afd.kernels.moe.config_table`; token counts not tuned now keep their rows) and go to
$OUT; a table of the winners is printed. `--fp8` tunes FP8 experts (e4m3, 128×128 block scales, tokens and
SiLU·up quantized per 128 columns) over a smaller space (BLOCK_K 128, gate_up's BLOCK_N 128) into
their own table; `--deadline` stops before a token count once that many seconds of timing have passed.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import require_cuda, time_graph, write_json  # noqa: E402
from bench.harness.shapes import MOE_SHAPES  # noqa: E402

TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


LAYOUTS: set[int] = set()  # --layouts: the layout block-Ms allowed (empty: all)


def block_ms(tokens: int, slots: int, experts: int) -> tuple[int, ...]:
    """Block-M values worth trying for `tokens` (by rows per expert), within --layouts where one fits."""
    tried = _block_ms(tokens, slots, experts)
    return tuple(bm for bm in tried if bm in LAYOUTS) or tried if LAYOUTS else tried


def _block_ms(tokens: int, slots: int, experts: int) -> tuple[int, ...]:
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


KERNELS = ("gate_up", "down")
FIRST_GROUP_M = 8  # every candidate is timed in the old order (0: one group) and in groups of this many tiles
GROUP_MS = (0, 1, 4, FIRST_GROUP_M, 16)  # tiles per program group tried again on each kernel's three leaders


def kernel_block_ms(layout_m: int) -> tuple[int, ...]:
    """A kernel's own tile heights over a layout of `layout_m`: the layout's, or half (tiles of padding exit)."""
    return (layout_m, layout_m // 2) if layout_m >= 32 else (layout_m,)


def load_options(kernel: str, block_m: int, tma: bool, fp8: bool = False) -> list[dict]:
    """How a kernel may load its operands: pointers or TMA (where available), one program per job or
    persistent (with TMA: one program per multiprocessor looping over the used tiles' jobs); gate_up also
    from rows gathered first (GATHER) — with TMA, which only that makes possible for its rows, and with
    pointers on tiles of 64+ rows — and, with TMA, its gate and up blocks in one box and one dot (ONE_DOT), or,
    FP8 on tiles of 64+ rows, a column block in two passes of one dot each (HALVES, one program per job:
    FP8's two accumulators and scaled product spill; bf16 adds each product in the dot)."""
    options = [{"TMA": False, "PERSISTENT": 0}]
    if tma:
        options += [{"TMA": True, "PERSISTENT": persistent} for persistent in (0, 1)]
    if kernel != "gate_up":
        return options
    return [{**option, "GATHER": gather, "ONE_DOT": one_dot, **({"HALVES": True} if halves else {})}
            for option in options for gather in (False, True) for one_dot in (False, True) for halves in (False, True)
            if (not gather or option["TMA"] or block_m >= 64) and (not one_dot or option["TMA"])
            and (not halves or (fp8 and block_m >= 64 and not one_dot and not option["PERSISTENT"]))]


FP8_MAX_REGISTERS = 192  # float32 accumulator registers per thread (of 255) past which an FP8 tile is not tried


def register_caps(kernel: str, warps: int, stages: int, loads: dict) -> tuple[int, ...]:
    """MAX_REGS tried besides ptxas' choice on an FP8 candidate with TMA (pointer tiles' addresses spill in the
    loop): 168 on HALVES of 4 warps (three programs a multiprocessor instead of two; ~2 spilled registers a step as
    compiled for sm_90a), 128 on 3-stage tiles of 8 warps — down's, HALVES' — (two programs instead of one; ~35
    spill loads and stores a step)."""
    if not loads["TMA"] or loads.get("PERSISTENT"):
        return ()
    if warps == 4 and loads.get("HALVES"):
        return (168,)
    if warps == 8 and stages == 3 and (kernel == "down" or loads.get("HALVES")):
        return (128,)
    return ()


def candidates(kernel: str, block_m: int, tma: bool, fp8: bool = False) -> list[dict]:
    """Settings tried for `kernel` at a tile height: small tiles stream weights, large ones feed the tensor cores.
    FP8: gate_up's columns in blocks of 128 (its epilogue quantizes per 128), steps of 128 (one scale group), down
    64-256 columns, 8 warps only on tiles of 64+ rows, 2 stages too on tiles of 64+ rows of 4 warps (two such
    programs share a multiprocessor's shared memory), no tile whose accumulators would spill
    (`moe_launch.fp8_accumulator_registers`); TMA or pointers, persistent or not, as for bf16; HALVES of 4 warps
    with TMA also capped (`register_caps`: more programs a multiprocessor)."""
    from afd.kernels.moe_launch import fp8_accumulator_registers

    if fp8:
        columns = (128,) if kernel == "gate_up" else (64, 128) if block_m <= 32 else (128, 256)
        space = itertools.product(columns, (128,), (4,) if block_m <= 32 else (4, 8), (3, 4))
        if block_m >= 64:
            space = itertools.chain(space, itertools.product(columns, (128,), (4,), (2,)))
        return [dict(BLOCK_M=block_m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s, GROUP_M=0, **loads, **cap)
                for (n, k, w, s), loads in itertools.product(space, load_options(kernel, block_m, tma, fp8))
                if not (loads.get("HALVES") and s == 2)  # HALVES' 64-row programs share a multiprocessor at 3
                for cap in ({}, *({"MAX_REGS": regs} for regs in register_caps(kernel, w, s, loads)))
                if fp8_accumulator_registers(kernel, block_m, n, w, loads.get("ONE_DOT", False),
                                             loads.get("HALVES", False)) <= FP8_MAX_REGISTERS]
    if block_m <= 32:
        space = itertools.product((32, 64, 128), (64, 128, 256), (4,), (3, 4, 5))
    else:
        space = itertools.product((64, 128, 256), (64, 128), (4, 8), (3, 4))
    return [dict(BLOCK_M=block_m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s, GROUP_M=0, **loads)
            for (n, k, w, s), loads in itertools.product(space, load_options(kernel, block_m, tma))
            if not (loads.get("ONE_DOT") and n > 128)]  # one dot of 2·256 columns: too wide to pay


def is_legacy(cfg: dict, layout_m: int) -> bool:
    """Whether `cfg` was in the old search space (layout tiles, column-major order, pointer loads, no GATHER,
    not persistent)."""
    return (cfg["BLOCK_M"] == layout_m and not cfg["GROUP_M"] and not cfg["TMA"] and not cfg.get("GATHER")
            and not cfg.get("PERSISTENT"))


def cfg_key(kernel: str, cfg: dict) -> tuple:
    """What a compiled variant depends on (GROUP_M is a run-time argument)."""
    return kernel, json.dumps({**cfg, "GROUP_M": 0}, sort_keys=True)


class Problem:
    """One token count's routing and buffers, for timing either kernel under any setting."""

    def __init__(self, gate_up, down, num_shared: int, top_k: int, tokens: int, seed: int = 0, scales=None):
        from afd.kernels import fp8_gemm, moe_align, moe_triton

        self.moe_align, self.moe_triton = moe_align, moe_triton
        self.gate_up, self.down, self.num_shared = gate_up, down, num_shared
        self.scales = scales  # FP8: (gate_up_scale, down_scale)
        experts, hidden, inter = down.shape
        generator = torch.Generator(device="cuda").manual_seed(seed)
        scores = torch.rand(tokens, experts - num_shared, device="cuda", generator=generator)
        self.weights, self.ids = scores.topk(top_k, dim=-1)
        self.weights = self.weights.to(torch.bfloat16)
        self.x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", generator=generator)
        self.x_scale = None
        if scales is not None:  # the kernels read the tokens quantized (per_token_group_quant runs once per layer)
            self.x, self.x_scale = fp8_gemm.per_token_group_quant(self.x)
        self.top_k, self.slots = top_k, top_k + num_shared
        self.num_pairs = tokens * self.slots
        self.layouts = {}
        self.inter, self.hidden = inter, hidden

    def layout(self, block_m: int):
        if block_m not in self.layouts:
            layout = self.moe_align.align(self.ids, self.num_shared, self.down.shape[0], block_m)
            rows = layout.pairs.shape[0]
            act = torch.randn(rows, self.inter, dtype=torch.bfloat16, device="cuda").to(self.x.dtype)
            tokens = self.num_pairs // self.slots  # routed pairs' rows here, the shared experts' apart in float32
            out = torch.empty(tokens * self.top_k, self.hidden, dtype=torch.bfloat16, device="cuda")
            shared_out = torch.empty(tokens * self.num_shared, self.hidden, device="cuda") if self.num_shared else None
            x_rows = torch.empty(rows, self.hidden, dtype=self.x.dtype, device="cuda")  # for GATHER
            act_scale = torch.rand(rows, self.inter // 128, device="cuda") * 1e-2 if self.scales else None
            self.layouts[block_m] = (layout, act, (out, shared_out), x_rows, act_scale)
        return self.layouts[block_m]

    def launcher(self, kernel: str, block_m: int, cfg: dict):
        layout, act, (out, shared_out), x_rows, act_scale = self.layout(block_m)
        gate_up_scale, down_scale = self.scales or (None, None)
        if kernel == "gate_up":
            scales = {"x_scale": self.x_scale, "w_scale": gate_up_scale, "act_scale": act_scale} if self.scales else {}
            return lambda: self.moe_triton.launch_gate_up(
                self.x, self.gate_up, act, layout, self.num_pairs, self.slots, block_m, cfg, x_rows, **scales)
        scales = {"act_scale": act_scale, "w_scale": down_scale} if self.scales else {}
        return lambda: self.moe_triton.launch_down(
            act, self.down, out, layout, self.weights, self.num_pairs, self.top_k, self.slots, block_m, cfg, **scales,
            shared_out=shared_out)


def random_experts(shape: dict, fp8: bool = False, max_routed: int | None = None):
    """Random expert weights of `shape` (a `MOE_SHAPES` entry), shared experts last: (gate_up, down) bf16, or with
    `fp8` e4m3 with random block scales ((gate_up_scale, down_scale) third). `max_routed` caps the routed experts
    (a compile worker needs the shapes, not every expert)."""
    routed = min(shape["routed"], max_routed or shape["routed"])
    experts, hidden, inter = routed + shape["shared"], shape["hidden"], shape["inter"]
    if not fp8:
        gate_up = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16, device="cuda") * 0.02
        down = torch.randn(experts, hidden, inter, dtype=torch.bfloat16, device="cuda") * 0.02
        return gate_up, down, None
    blocks = -(-hidden // 128), inter // 128
    scales = (torch.rand(experts, 2 * blocks[1], blocks[0], device="cuda") * 1e-3,
              torch.rand(experts, *blocks, device="cuda") * 1e-3)
    gate_up, down = _e4m3_stack(experts, 2 * inter, hidden), _e4m3_stack(experts, hidden, inter)
    torch.cuda.empty_cache()  # the bf16 chunks' blocks back to the driver: the compile workers share this GPU
    return gate_up, down, scales


def _e4m3_stack(experts: int, rows: int, cols: int) -> torch.Tensor:
    """[experts, rows, cols] e4m3 of N(0, 20²) values, made 16 experts at a time (DeepSeek-V3's whole bf16 stack
    would take 23 GB of an 80 GB card beside the compile workers: session 47 ran out of memory)."""
    return torch.cat([(torch.randn(min(16, experts - first), rows, cols, dtype=torch.bfloat16, device="cuda") * 20)
                      .to(torch.float8_e4m3fn) for first in range(0, experts, 16)])


COMPILE_ROUTED = 16  # routed experts of a compile worker's FP8 problem (the variants do not depend on the count)


def compile_jobs(shape_and_jobs: tuple) -> tuple[list, list]:
    """Worker: run each (kernel, layout block_m, cfg, tokens) once so Triton compiles and caches it; returns the
    failures and each compiled variant's (kernel, cfg, registers per thread, spilled registers)."""
    sys.path.insert(0, str(REPO / "runtime"))
    from afd.kernels import moe_launch  # local import: a spawned worker finds the runtime only after the line above

    shape_name, fp8, jobs = shape_and_jobs
    shape = MOE_SHAPES[shape_name]
    gate_up, down, scales = random_experts(shape, fp8, COMPILE_ROUTED if fp8 else None)
    problems, failed, compiled = {}, [], []
    for kernel, block_m, cfg, tokens in jobs:
        problem = problems.setdefault(tokens, Problem(gate_up, down, shape["shared"], shape["top_k"], tokens,
                                                      scales=scales))
        lowered = moe_launch.lowered_entries()
        try:
            binary = problem.launcher(kernel, block_m, cfg)()
            torch.cuda.synchronize()
        except Exception as err:  # out of shared memory or registers: not a candidate
            failed.append((kernel, cfg, type(err).__name__))
        else:
            if moe_launch.lowered_entries() > lowered:  # ran at fewer stages than asked (shared memory): another
                # candidate's variant, and its re-lowering inside a graph capture broke the capture (session 46)
                failed.append((kernel, cfg, "OutOfResources: stages lowered"))
            else:
                compiled.append((kernel, cfg, getattr(binary, "n_regs", None), getattr(binary, "n_spills", None)))
    return failed, compiled


def precompile(shape_name: str, layouts: set[int], kernels: tuple[str, ...], workers: int, tma: bool,
               one_token: bool, fp8: bool = False) -> set:
    """Compile every candidate of `kernels` over the layouts' block-Ms in parallel; returns the `cfg_key`s
    that failed."""
    jobs = []
    for block_m in sorted({sub for layout_m in layouts for sub in kernel_block_ms(layout_m)}):
        for kernel in kernels:
            for cfg in candidates(kernel, block_m, tma, fp8):
                jobs.append((kernel, block_m, cfg, 64))  # the variant does not depend on the layout: the smallest
                if block_m == 16 and one_token:
                    jobs.append((kernel, block_m, cfg, 1))  # odd pair counts specialise differently
    started = time.monotonic()
    chunks = [(shape_name, fp8, jobs[i::workers]) for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.map(compile_jobs, chunks)
    failures = [failure for chunk, _ in results for failure in chunk]
    why = collections.Counter((kernel, describe_loads(cfg), error) for kernel, cfg, error in failures)
    print(f"compiled {len(jobs)} kernel variants in {time.monotonic() - started:.0f} s "
          f"({len(failures)} fail: {dict(why)})", flush=True)
    for kernel, cfg, regs, spills in sorted({cfg_key(kernel, cfg): (kernel, cfg, regs, spills)
                                             for _, chunk in results for kernel, cfg, regs, spills in chunk}.values(),
                                            key=lambda item: (item[0], describe(item[1]))):
        REGISTERS[cfg_key(kernel, cfg)] = {"registers": regs, "spills": spills}
        if spills:
            print(f"  spills: {kernel} {describe(cfg)}: {regs} registers, {spills} spilled", flush=True)
    return {cfg_key(kernel, cfg) for kernel, cfg, _ in failures}


REGISTERS: dict[tuple, dict] = {}  # cfg_key → the compiled variant's registers per thread and spills (on CUDA)


def tune_kernel(problem: Problem, kernel: str, layout_m: int, failed: set, tma: bool,
                fp8: bool = False) -> tuple[float, dict, float]:
    """(ms, settings) of the fastest candidate of `kernel` over the layout `layout_m`, and the legacy best ms."""
    def timed(cfg: dict, iters: int = 10) -> tuple[float, dict]:
        return time_graph(problem.launcher(kernel, layout_m, cfg), iters=iters), cfg

    times = [timed({**cfg, "GROUP_M": group_m}) for sub in kernel_block_ms(layout_m)
             for cfg in candidates(kernel, sub, tma, fp8) if cfg_key(kernel, cfg) not in failed
             for group_m in (0, FIRST_GROUP_M)]
    legacy = min((ms for ms, cfg in times if is_legacy(cfg, layout_m)), default=float("nan"))
    if any(cfg.get("HALVES") for _, cfg in times):  # the best of the other forms, beside HALVES' best
        for halves in (False, True):
            best = min(((ms, cfg) for ms, cfg in times if cfg.get("HALVES", False) == halves), default=None,
                       key=lambda pair: pair[0])
            if best:
                print(f"  {kernel} at {problem.num_pairs // problem.slots} tokens, best "
                      f"{'with' if halves else 'without'} HALVES: {best[0]:.3f} ms {describe(best[1])}", flush=True)
    leaders = {}  # the three fastest settings, whatever their order
    for _, cfg in sorted(times, key=lambda pair: pair[0]):
        leaders.setdefault(cfg_key(kernel, cfg), cfg)
        if len(leaders) == 3:
            break
    if not leaders:
        raise RuntimeError(f"every {kernel} candidate failed to compile at block_m {layout_m} (see the compile line)")
    final = [timed({**cfg, "GROUP_M": group_m}, iters=30) for cfg in leaders.values()
             for group_m in GROUP_MS]  # the leaders under every order, timed longer
    ms, cfg = min(final, key=lambda pair: pair[0])
    return ms, cfg, legacy


def tune(problem: Problem, tokens: int, failed: set, tma: bool, kernels: tuple[str, ...], kept: dict | None,
         fp8: bool = False) -> dict:
    """The best settings for one token count, with their times: `kernels` tuned over every layout, or — when
    `kept` (the table's row) is given — over its layout, the other kernel keeping its setting (timed again)."""
    best = None
    experts = problem.down.shape[0]
    for block_m in block_ms(tokens, problem.slots, experts) if kept is None else (kept["BLOCK_M"],):
        entry = {"BLOCK_M": block_m}
        for kernel in KERNELS:
            if kernel in kernels:
                entry[f"{kernel}_ms"], entry[kernel], entry[f"{kernel}_legacy_ms"] = tune_kernel(
                    problem, kernel, block_m, failed, tma, fp8)
            else:
                entry[kernel], entry[f"{kernel}_legacy_ms"] = kept[kernel], kept.get(f"{kernel}_legacy_ms")
                entry[f"{kernel}_ms"] = time_graph(problem.launcher(kernel, block_m, kept[kernel]), iters=10)
            if cfg_key(kernel, entry[kernel]) in REGISTERS:
                entry[f"{kernel}_registers"] = REGISTERS[cfg_key(kernel, entry[kernel])]
        entry["align_ms"] = time_graph(lambda: problem.moe_align.align(problem.ids, problem.num_shared, experts, block_m))
        entry["total_ms"] = entry["gate_up_ms"] + entry["down_ms"] + entry["align_ms"]
        if best is None or entry["total_ms"] < best["total_ms"]:
            best = entry
    return best


def describe_loads(cfg: dict) -> str:
    return (("TMA" if cfg["TMA"] else "pointers") + (" GATHER" if cfg.get("GATHER") else "")
            + (" ONE_DOT" if cfg.get("ONE_DOT") else "") + (" HALVES" if cfg.get("HALVES") else "")
            + (" persistent" if cfg.get("PERSISTENT") else "")
            + (f" maxreg{cfg['MAX_REGS']}" if cfg.get("MAX_REGS") else ""))


def describe(cfg: dict) -> str:
    return (f"M{cfg['BLOCK_M']} N{cfg['BLOCK_N']} K{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']} "
            f"G{cfg['GROUP_M']} {describe_loads(cfg)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="deepseek-v2-lite", choices=sorted(MOE_SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help="the kernels to tune; one alone keeps the table's layout and the other kernel's setting")
    parser.add_argument("--fp8", action="store_true", help="FP8 experts (block scales), into their own table")
    parser.add_argument("--layouts", default="",
                        help="layout block-Ms allowed, e.g. 16,64 (a token count none of whose own fits keeps its own)")
    parser.add_argument("--deadline", type=float, default=0,
                        help="seconds of timing after which no further token count is started (0: none)")
    args = parser.parse_args()
    require_cuda(__file__)
    sizes = [int(t) for t in args.tokens.split(",")]
    LAYOUTS.update(int(bm) for bm in args.layouts.split(",") if bm)
    kernels = tuple(args.kernels.split(","))
    if not kernels or set(kernels) - set(KERNELS):
        parser.error(f"--kernels {args.kernels!r}: a comma-separated subset of {','.join(KERNELS)}")
    from afd.kernels.moe import CONFIG_DIR, config_name
    from afd.kernels.moe_launch import tma_supported

    shape = MOE_SHAPES[args.shape]
    num_shared, top_k = shape["shared"], shape["top_k"]
    slots = top_k + num_shared
    gate_up, down, scales = random_experts(shape, args.fp8)
    experts, hidden, inter = down.shape
    device = torch.cuda.get_device_name()
    name = config_name(experts, hidden, inter, device, args.fp8)
    path = CONFIG_DIR / name
    kept = json.loads(path.read_text())["configs"] if path.is_file() else {}  # token counts not tuned this time
    partial = set(kernels) != set(KERNELS)
    if partial and (missing := [t for t in sizes if str(t) not in kept]):
        parser.error(f"{path.name} has no row for {missing} tokens to keep the other kernel from; tune both kernels")
    layouts = ({kept[str(t)]["BLOCK_M"] for t in sizes} if partial
               else {bm for t in sizes for bm in block_ms(t, slots, experts)})
    tma = tma_supported(down.device)
    print(f"TMA descriptors {'tried' if tma else 'not available here'}", flush=True)
    failed = precompile(args.shape, layouts, kernels, args.workers, tma, 1 in sizes, args.fp8)
    table, started = {}, time.monotonic()
    for tokens in sizes:
        if args.deadline and time.monotonic() - started > args.deadline:
            print(f"deadline: {tokens} tokens and after not tuned", flush=True)
            break
        problem = Problem(gate_up, down, num_shared, top_k, tokens, scales=scales)
        table[tokens] = tune(problem, tokens, failed, tma, kernels, kept[str(tokens)] if partial else None, args.fp8)
        row = table[tokens]
        print(f"tokens {tokens:>5}: BM {row['BLOCK_M']:>3} " + " | ".join(
            f"{kernel} {row[f'{kernel}_ms']:.3f} ms (legacy {row[f'{kernel}_legacy_ms'] or float('nan'):.3f}) "
            f"{describe(row[kernel])} {row.get(f'{kernel}_registers', {}).get('registers')} regs"
            for kernel in KERNELS) + f" | align {row['align_ms']:.3f} ms", flush=True)
        # after each token count: a cut-off run keeps its rows
        document = save_table(path, kept, table, device, args.fp8)
    print(f"timed in {time.monotonic() - started:.0f} s")
    json_name = "moe_tune" if args.shape == "deepseek-v2-lite" else f"moe_tune-{args.shape}"
    write_json(json_name + ("-fp8" if args.fp8 else ""), {"file": name, **document})
    print(f"wrote {path}")


def save_table(path: Path, kept: dict, table: dict, device: str, fp8: bool = False) -> dict:
    """Write the table file: `kept`'s rows with this run's rows merged in; returns its document."""
    configs = {**kept, **{str(tokens): row for tokens, row in table.items()}}
    import triton  # local import: the tuner runs where Triton does

    document = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
                **({"fp8": True} if fp8 else {}),
                "configs": dict(sorted(configs.items(), key=lambda item: int(item[0])))}
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return document


if __name__ == "__main__":
    main()
