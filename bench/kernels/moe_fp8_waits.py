"""Compile the FP8 MoE kernels for Hopper (sm_90a) on this machine, no GPU needed, and print for each setting the
sequence of wgmma dots and waits in its K loop, the registers / stack bytes ptxas gives a thread and the shared
memory it needs.

    python3 bench/kernels/moe_fp8_waits.py                 # the settings in SETTINGS
    python3 bench/kernels/moe_fp8_waits.py --json          # one JSON line per setting (what the tests read)

A `dot` followed by `wait0` in the loop is synchronous: the tensor cores idle until its step's promotion is done
(every FP8 dot is, as the block scales are applied to each step's product). Session 47 measured a Gluon form of both
kernels that leaves each step's wgmma in flight while the step before is promoted (commit 5085b88): no faster at
1,024-4,096 tokens, so those waits are not what the FP8 MoE's time is (bench/RESULTS.md, issue 32, session 47).
Compiled by the Triton installed here (3.7 here; the device runs 3.6); pointer and size arguments are marked
16-divisible, as the launcher's specialization marks the real ones.
Needs Triton's NVIDIA backend (its bundled ptxas and cuobjdump), and TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

HOPPER = GPUTarget("cuda", 90, 32)
DIVISIBLE = ("hidden", "inter")  # sizes that are multiples of 128 in every FP8 model


def compile_variant(fn, signature: dict, constants: dict, warps: int, stages: int):
    """triton.compile of `fn` for Hopper with `signature` (name → Triton type) and `constants`."""
    names = list(fn.arg_names)
    if "GDC" in names:  # programmatic dependent launch off, as served by default (afd.kernels.pdl)
        constants = {"GDC": 0, **constants}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
             if kind.startswith("*") or name in DIVISIBLE}
    source = ASTSource(fn, {**signature, **{name: "constexpr" for name in constants}}, constants, attrs)
    return triton.compile(source, target=HOPPER, options={"num_warps": warps, "num_stages": stages})


def loop_sequence(ttgir: str) -> str:
    """The wgmma dots and waits of the first K loop, in order, e.g. "dot wait0 dot" (the yield ends it)."""
    start = ttgir.index("scf.for")
    body = ttgir[start:ttgir.index("scf.yield", start)]
    ops = re.findall(r"ttng\.warp_group_dot_wait [^\n]*?pendings = (\d+)|(ttng\.warp_group_dot) ", body)
    return " ".join(f"wait{pendings}" if pendings else "dot" for pendings, _ in ops)


def resources(cubin: bytes) -> dict:
    """Registers per thread and stack bytes (spills live there) of a compiled kernel, by cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True,
                               check=True).stdout
    return {key.lower(): int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK")}


def fp8_desc(*block: int) -> str:
    return f"tensordesc<fp8e4nv[{', '.join(map(str, block))}]>"


def down(block_m: int, block_n: int, block_k: int, warps: int, stages: int):
    """The FP8 down kernel with TMA loads."""
    from afd.kernels import moe_triton

    signature = {"act": fp8_desc(block_m, block_k), "w": fp8_desc(block_n, block_k),
                 "out_ptr": "*bf16", "shared_ptr": "*fp32", "pairs_ptr": "*i32", "tile_expert_ptr": "*i32",
                 "used_tiles_ptr": "*i32", "weights_ptr": "*bf16", "act_scale": "*fp32", "w_scale": "*fp32",
                 "num_pairs": "i32", "top_k": "i32", "slots": "i32", "hidden": "i32", "inter": "i32",
                 "layout_m": "i32", "group_m": "i32"}
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, TMA=True, FP8=True, PERSISTENT=False,
                     PROGRAMS=0, SHARED_APART=True)
    return compile_variant(moe_triton.down_kernel, signature, constants, warps, stages)


def gate_up(block_m: int, block_n: int, block_k: int, warps: int, stages: int, one_dot: bool, halves: bool = False):
    """The FP8 gate_up kernel with GATHER and TMA loads, its gate and up blocks in one box (ONE_DOT) or two, or
    its column block in two passes of one box and one dot (HALVES)."""
    from afd.kernels import moe_triton

    signature = {"x": fp8_desc(block_m, block_k),
                 "w": fp8_desc(2, block_n, block_k) if one_dot else fp8_desc(2, block_n // 2, block_k) if halves
                 else fp8_desc(block_n, block_k),
                 "act_ptr": "*fp8e4nv", "pairs_ptr": "*i32", "tile_expert_ptr": "*i32", "used_tiles_ptr": "*i32",
                 "x_scale": "*fp32", "w_scale": "*fp32", "act_scale": "*fp32", "num_pairs": "i32", "slots": "i32",
                 "hidden": "i32", "inter": "i32", "layout_m": "i32", "group_m": "i32"}
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, TMA=True, GATHER=True, ONE_DOT=one_dot,
                     FP8=True, PERSISTENT=False, PROGRAMS=0, HALVES=halves)
    return compile_variant(moe_triton.gate_up_kernel, signature, constants, warps, stages)


SETTINGS = [  # (kernel, settings): the session-40 winners at 1,024-4,096 tokens and their neighbours
    ("gate_up", dict(block_m=64, block_n=128, block_k=128, warps=8, stages=3, one_dot=True)),
    ("gate_up", dict(block_m=64, block_n=128, block_k=128, warps=8, stages=3, one_dot=False)),
    # HALVES (issue 54): one BM×128 accumulator a pass, so 64-row tiles of 4 warps share a multiprocessor
    ("gate_up", dict(block_m=64, block_n=128, block_k=128, warps=4, stages=3, one_dot=False, halves=True)),
    ("gate_up", dict(block_m=128, block_n=128, block_k=128, warps=8, stages=3, one_dot=False, halves=True)),
    ("down", dict(block_m=64, block_n=128, block_k=128, warps=4, stages=3)),
    ("down", dict(block_m=128, block_n=128, block_k=128, warps=8, stages=3)),
]


def describe(kernel: str, settings: dict) -> dict:
    compiled = (gate_up if kernel == "gate_up" else down)(**settings)
    return {"kernel": kernel, **settings, "loop": loop_sequence(compiled.asm["ttgir"]),
            **resources(compiled.asm["cubin"]), "shared_bytes": compiled.metadata.shared}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object a line")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    for kernel, settings in SETTINGS:
        row = describe(kernel, settings)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{kernel:>7} M{settings['block_m']} N{settings['block_n']} w{settings['warps']}"
                  f" s{settings['stages']}{' ONE_DOT' if settings.get('one_dot') else ''}"
                  f"{' HALVES' if settings.get('halves') else ''}: loop [{row['loop']}], "
                  f"{row['reg']} registers, {row['stack']} stack bytes, {row['shared_bytes']} shared bytes", flush=True)


if __name__ == "__main__":
    main()
