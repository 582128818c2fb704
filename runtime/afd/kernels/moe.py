"""Routed (and fused shared) experts on CUDA without a host synchronisation.

Two implementations of one function, `experts(x, weights, ids, gate_up, down)`:
`triton` (alignment, `moe_align`, + two fused GEMM kernels, `moe_triton`, launched by `moe_launch`, + the slot
sum, `moe_rows`, with block sizes from a table tuned per shape and device by `bench/kernels/moe_tune.py`) and
`grouped` (`torch._grouped_mm` with a gather and a reordering pass). Both are capturable in CUDA graphs:
every shape follows from the token count, never from the routing. `AFD_MOE_KERNEL` picks one
(auto|triton|grouped); auto prefers Triton when it imports. Up to `AFD_MOE_SMALL_TOKENS` tokens (default 8)
`triton` takes `moe_small` for 16-bit experts: a GEMV per (token, expert) pair and one per token summing its
slots, two launches, the same roundings (K summed in another order); FP8 experts keep the aligned path.

Shared experts of width n·I are folded in as n extra experts that every token visits
with weight 1 (`fuse_shared_experts`), so one kernel pair does the whole MoE layer. A routed
pair's row is rounded to x's dtype before the token's float32 sum, a shared expert's is kept
in float32: an expert-parallel shard holds only a column slice of a shared expert (its part
of the sum, `afd.models.shared_stack`), and a whole shared output rounded before the sum is
a rounding no shard could repeat (issue 32, session 41).

FP8 experts (e4m3 stacks with 128×128 block scales, `gate_up_scale` [E, 2I/128, H/128] and
`down_scale` [E, H/128, I/128]) run in the same Triton kernels in FP8: the tokens are quantized
per 128 columns once (`fp8_gemm.per_token_group_quant`), gate_up writes SiLU·up quantized the
same way for down, each from its own tuned table (`..._fp8_DEVICE.json`). The `grouped` choice
multiplies FP8 experts by their dequantized weights (a reference, not a fast path).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from afd.config import process_setting
from afd.kernels import triton_available
from afd.kernels.fp8_blocks import check_fp8, dequantize_block_fp8  # check_fp8: also moe_small's


def kernel_choice() -> str:
    choice = process_setting("AFD_MOE_KERNEL")  # auto, triton or grouped (a ConfigError names a bad one)
    if choice == "auto":
        return "triton" if triton_available() else "grouped"
    return choice


def small_tokens() -> int:
    """Token counts up to which `experts_triton` takes the small-token path (`moe_small`); 0: never."""
    return process_setting("AFD_MOE_SMALL_TOKENS")


# tokens → settings: the layout's BLOCK_M, and per kernel BLOCK_N/BLOCK_K/num_warps/num_stages plus,
# optionally, its own BLOCK_M, GROUP_M, TMA, PERSISTENT, MAX_REGS and (gate_up) GATHER, ONE_DOT or HALVES (defaults
# in `moe_launch.kernel_settings`: the old behaviour).
FP8_DEFAULT_CONFIGS = {  # FP8 experts where no tuned table fits: BLOCK_K 128 (one scale group, 128 bytes a row),
    # gate_up's BLOCK_N 128 (its epilogue quantizes act per 128 columns); TMA loads on Hopper (pointers elsewhere).
    # Tall tiles keep at most 128 float32 accumulator registers a thread (FP8 holds each step's scaled product
    # apart from the accumulator: moe_launch.fp8_accumulator_registers); taller ones spill
    1: {"BLOCK_M": 16, "gate_up": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "TMA": True},
        "down": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "TMA": True}},
    256: {"BLOCK_M": 32, "gate_up": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "TMA": True},
          "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "TMA": True}},
    1024: {"BLOCK_M": 64, "gate_up": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "TMA": True,
                                      "ONE_DOT": True},
           "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "TMA": True}},
    4096: {"BLOCK_M": 64, "gate_up": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "TMA": True,
                                      "ONE_DOT": True, "GROUP_M": 16},
           "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "TMA": True, "GROUP_M": 4}},
}  # 1024 and 4096: what bench/kernels/moe_tune.py --fp8 chose at both sample shapes on an H200 (session 40)
DEFAULT_CONFIGS = {  # used where no tuned table fits the shapes and device
    1: {"BLOCK_M": 16, "gate_up": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
        "down": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}},
    256: {"BLOCK_M": 32, "gate_up": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
          "down": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}},
    1024: {"BLOCK_M": 64, "gate_up": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
           "down": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}},
}
CONFIG_DIR = Path(__file__).with_name("configs")


def config_name(num_experts: int, hidden: int, inter: int, device_name: str, fp8: bool = False) -> str:
    """File name of a tuned table (written by `bench/kernels/moe_tune.py`); FP8 experts have tables of their own."""
    return f"E{num_experts}_H{hidden}_I{inter}_{'fp8_' if fp8 else ''}{device_name.replace(' ', '_')}.json"


def config_table(num_experts: int, hidden: int, inter: int, device_name: str, fp8: bool = False) -> dict[int, dict]:
    """The tuned table for these shapes (and weight format) on this device, else the defaults (read once)."""
    return _read_table(num_experts, hidden, inter, device_name, bool(fp8))


@functools.lru_cache(maxsize=None)
def _read_table(num_experts: int, hidden: int, inter: int, device_name: str, fp8: bool) -> dict[int, dict]:
    path = CONFIG_DIR / config_name(num_experts, hidden, inter, device_name, fp8)
    if not path.is_file():
        return FP8_DEFAULT_CONFIGS if fp8 else DEFAULT_CONFIGS
    return {int(tokens): cfg for tokens, cfg in json.loads(path.read_text())["configs"].items()}


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_table(device: torch.device, num_experts: int, hidden: int, inter: int, fp8: bool = False) -> dict[int, dict]:
    """`config_table` for the GPU `device` is on."""
    return config_table(num_experts, hidden, inter, _device_name(device.index), fp8)


def pick_config(table: dict[int, dict], tokens: int) -> dict:
    """The entry tuned for the nearest token count (pure)."""
    return table[min(table, key=lambda key: (abs(key - tokens), key))]


def add_shared(weights: torch.Tensor, ids: torch.Tensor, num_routed: int, num_shared: int):
    """Append the shared experts (ids num_routed.., weight 1) to every token's routing."""
    if not num_shared:
        return weights, ids
    tokens = ids.shape[0]
    shared_ids = torch.arange(num_routed, num_routed + num_shared, device=ids.device).expand(tokens, num_shared)
    shared_w = torch.ones(tokens, num_shared, dtype=weights.dtype, device=weights.device)
    return torch.cat((weights, shared_w), 1), torch.cat((ids, shared_ids), 1)


def experts_triton(x, weights, ids, gate_up, down, num_shared: int = 0, sum_dtype=None, gate_up_scale=None,
                   down_scale=None) -> torch.Tensor:
    """[T, H]: experts `ids` ([T, k]) weighted by `weights` ([T, k]), plus the last
    `num_shared` experts of `gate_up`/`down` at weight 1 for every token; summed into `sum_dtype`
    (default x's) — an expert-parallel shard returns its partial sum in float32. FP8 experts come
    with their block scales (`gate_up_scale`, `down_scale`). Each routed pair's weighted row is kept in x's
    dtype before the sum, each shared expert's in float32 (see the module's docstring); `ids` may have no
    column (k = 0: the shared experts only)."""
    from afd.kernels import batch_invariant, fp8_gemm, moe_align, moe_rows, moe_triton  # local import: Triton is optional: imported where it runs

    tokens, top_k = ids.shape
    invariant = batch_invariant.enabled()  # one setting and one path for every token count
    if 0 < tokens <= small_tokens() and gate_up_scale is None and not invariant:
        # two GEMV launches, no alignment or slot sum (the same roundings, K summed in another order); FP8 experts
        # keep the aligned path (measured faster)
        from afd.kernels import moe_small  # local import: Triton is optional: imported where it runs

        return moe_small.experts_small(x, weights, ids, gate_up, down, num_shared, sum_dtype, gate_up_scale,
                                       down_scale)
    num_experts, hidden, inter = down.shape
    slots = top_k + num_shared
    num_pairs = tokens * slots
    fp8 = check_fp8(gate_up, down, gate_up_scale, down_scale)
    cfg = pick_config(device_table(x.device, num_experts, hidden, inter, fp8),
                      batch_invariant.MOE_TOKENS if invariant else tokens)
    block_m = cfg["BLOCK_M"]
    layout = moe_align.align(ids, num_shared, num_experts, block_m)
    rows = layout.pairs.shape[0]
    x_in, scales = x.contiguous(), {}
    if fp8:  # each token quantized once per 128 columns; gate_up writes act in e4m3 with its scales
        x_in, x_scale = fp8_gemm.per_token_group_quant(x_in)
        act_scale = torch.empty(rows, inter // fp8_gemm.GROUP, dtype=torch.float32, device=x.device)
        scales = {"x_scale": x_scale, "w_scale": gate_up_scale, "act_scale": act_scale}
    act = torch.empty(rows, inter, dtype=x_in.dtype, device=x.device)  # [padded rows, I]
    x_rows = None  # [padded rows, H]: each row's token row, for a gate_up that reads them pre-gathered
    if cfg["gate_up"].get("GATHER", False):
        x_rows = torch.empty(rows, hidden, dtype=x_in.dtype, device=x.device)
    moe_triton.launch_gate_up(x_in, gate_up, act, layout, num_pairs, slots, block_m, cfg["gate_up"], x_rows,
                              **scales)
    out = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)  # [T*k, H]: routed pairs' rows
    shared_out = None  # [T*S, H] float32: the shared experts' rows
    if num_shared:
        shared_out = torch.empty(tokens * num_shared, hidden, dtype=torch.float32, device=x.device)
    moe_triton.launch_down(act, down, out, layout, weights.contiguous(), num_pairs, top_k, slots, block_m,
                           cfg["down"], **({"act_scale": act_scale, "w_scale": down_scale} if fp8 else {}),
                           shared_out=shared_out)
    if not top_k and num_shared == 1 and (sum_dtype or x.dtype) == torch.float32:
        return shared_out  # one float32 row a token: already the sum
    return moe_rows.sum_slots(out, slots, sum_dtype or x.dtype, shared_out, num_shared)


def experts_grouped(x, weights, ids, gate_up, down, sum_dtype=None) -> torch.Tensor:
    """The same function on `torch._grouped_mm`: gather, two grouped GEMMs, reorder, weighted sum."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.to(torch.int32), torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    hidden = torch._grouped_mm(x[order // top_k], gate_up.transpose(1, 2), offs=offsets)  # [T*k, 2I]
    gate, up = hidden.chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)  # [T*k, H] sorted
    unsorted = torch.empty_like(out).index_copy_(0, order, out).view(tokens, top_k, -1)
    if sum_dtype is not None:
        unsorted = unsorted.to(sum_dtype)
    return torch.bmm(weights.unsqueeze(1).to(unsorted.dtype), unsorted).squeeze(1)  # [T, H]


def experts_cuda(x, weights, ids, gate_up, down, num_shared: int = 0, sum_dtype=None, gate_up_scale=None,
                 down_scale=None) -> torch.Tensor:
    """The MoE output with the kernel `AFD_MOE_KERNEL` picks; the last `num_shared` experts are shared.
    FP8 experts pass their block scales. (The grouped reference keeps every pair's row in x's dtype.)"""
    if kernel_choice() == "triton":
        return experts_triton(x, weights, ids, gate_up, down, num_shared, sum_dtype, gate_up_scale, down_scale)
    if check_fp8(gate_up, down, gate_up_scale, down_scale):  # the reference path: dequantized weights
        gate_up = dequantize_block_fp8(gate_up, gate_up_scale, x.dtype)
        down = dequantize_block_fp8(down, down_scale, x.dtype)
    weights, ids = add_shared(weights, ids, gate_up.shape[0] - num_shared, num_shared)
    return experts_grouped(x, weights, ids, gate_up, down, sum_dtype)
