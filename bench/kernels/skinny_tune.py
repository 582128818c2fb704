"""Tune the skinny GEMM (afd.kernels.skinny_gemm) at the decode step's dense projections; write its table.

    python3 bench/kernels/skinny_tune.py [--shapes deepseek-v2-lite,qwen3-30b-a3b] [--rows 1,2,4,8,16] [--deadline 60]
                                 [--write]

The shapes are the GEMMs the decode path sends through `skinny_gemm.linear`, read off each sample model built
on the meta device as the GPU path builds it (fused input projections, o_proj, the router: DeepSeek's as three
bf16 parts with a float32 output, Qwen3's bf16 one with a float32 output). Per shape and row count M, the
kernel settings are timed against torch's GEMM (`skinny_gemm.torch_linear`, what runs today), each as a CUDA
graph of one launch per weight copy, with enough copies (over 256 MiB) that no weight is in L2 when read, as in
a decode step. The search: DOT x BLOCK_N x SPLIT_K (only splits giving 1/2 to 8 programs per SM) at BLOCK_K
256 (FMA: narrower where its product would spill), 4 warps, 3 stages; then BLOCK_K, warps and stages changed
one at a time around the best. Every candidate's output is checked against torch's first. Rows go M-major
(every shape at M = 1 first); `--deadline` stops before the next (shape, M) once that many seconds have
passed; each row is printed as it is measured.

Prints per (shape, M): the byte floor (weight + x + output bytes / the measured copy rate), torch's and the
best kernel's µs and ratios to the floor. The table maps every measured (N, K, M, output) to the best setting
where it beats torch by >= 5 %, else "cublas" (so that a row count between two measured ones, which takes the
next larger one's entry, stays on torch where that one does). It goes to $OUT/skinny_<DEVICE>.json, and with
`--write` also merged into runtime/afd/kernels/configs/ (read by `skinny_gemm.device_table`); no file is
written when the kernel won nowhere. Without a CUDA GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import ceilings, require_cuda, time_graph  # noqa: E402
from bench.harness.shapes import QWEN3_30B_A3B, V2_LITE  # noqa: E402

SHAPES = {"deepseek-v2-lite": V2_LITE, "qwen3-30b-a3b": QWEN3_30B_A3B}
WIN = 1.05  # torch's time over the kernel's at least this for a table entry
COPY_BYTES = 256 << 20  # weight copies per shape: more than the L2 holds


@dataclass(frozen=True)
class Gemm:
    model: str
    name: str
    n: int
    k: int
    out: str  # skinny_gemm.OUTPUTS: "input" or "float32"


def decode_gemms(model_name: str, config: dict) -> list[Gemm]:
    """The skinny GEMMs of one MoE decoder layer of `config`, as the GPU path builds it (on meta: no memory)."""
    from afd.models.layers import Router
    from afd.models.loader import build_share, finish_share

    config = dict(config, num_hidden_layers=max(2, int(config.get("first_k_dense_replace", 0)) + 1))
    model, _, _ = build_share(config, "monolithic", False, torch.bfloat16, "meta")
    finish_share(model, torch.bfloat16, "cuda")  # what a GPU gets: fused projections, router parts
    found: dict[tuple, Gemm] = {}
    for name, module in model.named_modules():
        weights = [(attr, getattr(module, attr, None), "input") for attr in ("in_weight", "qkv_weight")]
        if name.endswith("o_proj"):
            weights.append(("o_proj", module.weight, "input"))
        if isinstance(module, Router):
            parts = module.weight_parts is not None
            weights.append(("router parts" if parts else "router", module.weight_parts if parts else module.weight,
                            "float32"))
        for label, weight, out in weights:
            if weight is not None and weight.dtype == torch.bfloat16:
                gemm = Gemm(model_name, label, weight.shape[0], weight.shape[1], out)
                found.setdefault((gemm.n, gemm.k, gemm.out), gemm)
    return list(found.values())


def fits(setting: dict, m: int) -> bool:
    """Whether an FMA setting's [rows, BLOCK_N, BLOCK_K] product stays within ~128 float32 registers a thread
    (larger ones spill and compile slowly); dot settings always."""
    rows = 1 << (m - 1).bit_length()
    return setting["DOT"] or rows * setting["BLOCK_N"] * setting["BLOCK_K"] <= 128 * 32 * setting["num_warps"]


def candidates(n: int, sms: int, m: int) -> list[dict]:
    """The first sweep: DOT x BLOCK_N x SPLIT_K at BLOCK_K 256 (FMA: narrower where `fits` needs), 4 warps,
    3 stages."""
    out = []
    for dot in (False, True):
        for block_n in (16, 32, 64):
            blocks = -(-n // block_n)
            splits = [s for s in (1, 2, 4, 8, 16, 32) if sms // 2 <= blocks * s <= 8 * sms] or [1]
            for split in splits:
                for block_k in (256, 128, 64, 32):  # the widest that fits
                    setting = {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "DOT": dot, "num_warps": 4,
                               "num_stages": 3}
                    if fits(setting, m):
                        out.append(setting)
                        break
    return out


NEIGHBOURS = {"BLOCK_K": (128, 512), "num_warps": (2, 8), "num_stages": (2, 4, 5)}


def weight_copies(gemm: Gemm) -> list[torch.Tensor]:
    """Random bf16 weights of `gemm` on the GPU, enough copies to pass COPY_BYTES (2 to 64)."""
    count = max(2, min(64, -(-COPY_BYTES // (gemm.n * gemm.k * 2))))
    return [torch.randn(gemm.n, gemm.k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]


def timed(fn, copies: int) -> float:
    """µs of one call: a graph of one call per weight copy, replayed."""
    return time_graph(fn, 20) * 1e3 / copies


def tune_one(gemm: Gemm, m: int, weights: list[torch.Tensor], sms: int) -> dict:
    from afd.kernels import skinny_gemm

    out_dtype = torch.float32 if gemm.out == "float32" else None
    x = torch.randn(m, gemm.k, device="cuda", dtype=torch.bfloat16)
    want = skinny_gemm.torch_linear(x, weights[0], out_dtype).float()
    torch_us = timed(lambda: [skinny_gemm.torch_linear(x, w, out_dtype) for w in weights], len(weights))
    times: dict[str, float] = {}
    rejected = 0

    def measure(setting: dict) -> float:
        nonlocal rejected
        key = json.dumps(setting, sort_keys=True)
        if key not in times:
            try:
                got = skinny_gemm.gemm(x, weights[0], out_dtype, setting).float()
                ok = torch.allclose(got, want, rtol=2e-2, atol=2e-2)
            except Exception as err:  # a setting the compiler refuses (resources): not a candidate
                print(f"  {gemm.name} M={m} {setting}: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
                ok = False
            if not ok:
                rejected += 1
                times[key] = float("inf")
            else:
                times[key] = timed(lambda: [skinny_gemm.gemm(x, w, out_dtype, setting) for w in weights], len(weights))
        return times[key]

    best = min(candidates(gemm.n, sms, m), key=measure)
    for param, values in NEIGHBOURS.items():  # one at a time around the best
        for value in values:
            trial = {**best, param: value}
            if fits(trial, m) and measure(trial) < measure(best):
                best = trial
    return {"setting": best, "triton_us": measure(best), "torch_us": torch_us, "tried": len(times),
            "rejected": rejected}


def floor_us(gemm: Gemm, m: int, copy_bytes_per_s: float) -> float:
    moved = 2 * (gemm.n * gemm.k + m * gemm.k) + m * gemm.n * (4 if gemm.out == "float32" else 2)
    return moved / copy_bytes_per_s * 1e6


def merge(path: Path, entries: list[dict]) -> dict:
    """The table at `path` (if any) with `entries` replacing its rows of the same shapes."""
    from afd.kernels import skinny_gemm

    old = json.loads(path.read_text())["entries"] if path.is_file() else []
    if path.is_file():
        skinny_gemm.read_table(path)  # refuse to merge into a malformed table
    keys = {(e["n"], e["k"], e["m"], e["out"]) for e in entries}
    kept = [e for e in old if (e["n"], e["k"], e["m"], e["out"]) not in keys]
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "entries": kept + entries}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--deadline", type=float, default=0.0, help="seconds; 0: none")
    parser.add_argument("--write", action="store_true", help="also merge into runtime/afd/kernels/configs/")
    args = parser.parse_args()
    require_cuda(__file__)  # no table written either
    import triton

    from afd.kernels import skinny_gemm

    rows = [int(r) for r in args.rows.split(",")]
    if any(not 1 <= r <= skinny_gemm.MAX_ROWS for r in rows):
        parser.error(f"--rows must lie in 1..{skinny_gemm.MAX_ROWS}")
    gemms = [g for name in args.shapes.split(",") for g in decode_gemms(name, SHAPES[name])]
    copy_rate = ceilings()["copy_bytes_per_s"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}, copy {copy_rate / 1e12:.2f} TB/s")
    start = time.monotonic()
    weights = {g: weight_copies(g) for g in gemms}
    print(f"\n{'model':17} {'gemm':13} {'N':>5} {'K':>5} {'M':>3} {'out':>7} {'floor_us':>8} {'torch_us':>8} "
          f"{'x':>5} {'triton_us':>9} {'x':>5} {'gain':>5} choice")
    entries = []
    for m, g in [(m, g) for m in rows for g in gemms]:
        if args.deadline and time.monotonic() - start > args.deadline:
            print(f"deadline ({args.deadline:.0f} s) passed: not tuned from {g.model} {g.name} at M={m} on")
            break
        found, floor = tune_one(g, m, weights[g], sms), floor_us(g, m, copy_rate)
        gain = found["torch_us"] / found["triton_us"]
        choice = found["setting"] if gain >= WIN else "cublas"
        print(f"{g.model:17} {g.name:13} {g.n:5} {g.k:5} {m:3} {g.out:>7} {floor:8.2f} {found['torch_us']:8.2f} "
              f"{found['torch_us'] / floor:5.2f} {found['triton_us']:9.2f} {found['triton_us'] / floor:5.2f} "
              f"{gain:5.2f} {'cublas' if choice == 'cublas' else 'triton ' + json.dumps(choice)}", flush=True)
        entries.append({"n": g.n, "k": g.k, "m": m, "out": g.out, "setting": choice, "floor_us": round(floor, 3),
                        "torch_us": round(found["torch_us"], 3), "triton_us": round(found["triton_us"], 3),
                        "tried": found["tried"], "rejected": found["rejected"]})
    if not any(e["setting"] != "cublas" for e in entries):
        print("\nthe kernel beat torch by >= 5 % nowhere: no table written (torch's GEMM everywhere)")
        return 0
    name = skinny_gemm.table_name(device)
    out = Path(os.environ.get("OUT", "."))
    (out / name).write_text(json.dumps(merge(out / name, entries), indent=1))
    print(f"\nwrote {out / name}")
    if args.write:
        path = skinny_gemm.CONFIG_DIR / name
        path.write_text(json.dumps(merge(path, entries), indent=1))
        skinny_gemm.read_table(path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
