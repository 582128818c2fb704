"""The MoE layer for a few tokens (a decode step of batch 1–4): two GEMV kernels, no alignment, no slot sum.

At one token the aligned path (`moe_align` + `moe_triton`'s two GEMMs + `moe_rows.sum_slots`, + the activations'
quantization for FP8) spends more on its 4–5 launches than on streaming the experts (issue 33). Here:

- `gate_up`: one program per (pair, column block), pair p = token·(k+S) + slot as in `moe_align` (the S shared
  experts are experts num_routed.. in the last slots); it reads its expert id from `ids`, streams x[token]
  against that expert's gate and up rows and writes SiLU(gate)·up for the pair.
- `down`: one program per (token, column block), streaming the rows of all the token's k+S slots together (one
  [slots, BLOCK_N, BLOCK_K] tile a step); it sums weight·(act @ down[e]ᵀ) in float32, slot 0 first: a routed
  pair's weighted row rounded to x's dtype first, a shared expert's kept in float32 — the rounding
  `moe_triton._down_job` + `moe_rows.sum_slots` do — and stores the sum in `sum_dtype`.

Streaming at the copy rate takes megabytes in flight: both kernels keep float32 products per column in a
[.., BLOCK_N, BLOCK_K] accumulator (summed across columns once, after the loop) and issue their loads
`num_stages` − 1 steps ahead (`tl.range(num_stages=)`: cp.async into shared memory, plain loads are not pipelined).

FP8 experts (e4m3 stacks, 128×128 block scales): `gate_up` quantizes x[token] per 128 columns itself, as
`fp8_gemm.per_token_group_quant` does; act is quantized per 128 columns as `moe_triton`'s gate_up epilogue does —
in `gate_up` when its column block is 128 (act in e4m3 with its scales), else in `down` as it reads act (kept in
float32 between the two: the same values, and a narrower gate_up column block). Each column's product is scaled by
both groups' scales (`moe_triton` scales each 128-column product: the same up to float32 rounding). Every shape
follows from the token count: capturable in CUDA graphs. `moe.experts_triton` takes this path up to
`AFD_MOE_SMALL_TOKENS` tokens.
"""

from __future__ import annotations

import re

import torch
import triton
import triton.language as tl

from afd.kernels.fp8_blocks import check_fp8
from afd.kernels.fp8_gemm import FP8, FP8_MAX, GROUP, quant_groups

E4M3_MAX = tl.constexpr(FP8_MAX)  # a kernel reads only constexpr globals
MAX_TOKENS = 16  # the most tokens this path takes: every pair streams its expert on its own (no tiles)

KNOBS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")  # per kernel; num_stages: the K loop's depth (1: none)


def parse_label(label: str) -> dict:
    """One kernel's settings from a label such as "n16k256w4s3": BLOCK_N 16, BLOCK_K 256, 4 warps, 3 stages."""
    match = re.fullmatch(r"n(\d+)k(\d+)w(\d+)s(\d+)", label)
    if not match:
        raise ValueError(f"a small-path setting label looks like n16k256w4s3 (BLOCK_N, BLOCK_K, num_warps, "
                         f"num_stages); got {label!r}")
    return dict(zip(KNOBS, map(int, match.groups())))


def parse_settings(gate_up: str, down: str) -> dict:
    """Both kernels' settings from their labels (`parse_label`)."""
    return {"gate_up": parse_label(gate_up), "down": parse_label(down)}


def label(cfg: dict) -> str:
    """One kernel's settings as `parse_settings` reads them ("n16k256w4s3")."""
    return "n{BLOCK_N}k{BLOCK_K}w{num_warps}s{num_stages}".format(**cfg)


# FP8 → both kernels' settings: the T = 1 picks of `bench/kernels/moe_small.py --tokens 1,4,8 --variants 1,8` on an
# H100 (session 45), one row for every token count, so that a token's result does not depend on how many tokens
# share its step (the settings fix each column's summation order). gate_up runs one program per (pair, column
# block); down one per (token, column block), each streaming all the token's slots at once, so its column block is
# narrower still. FP8: BLOCK_K 128, BLOCK_N at most 128 (a gate_up block of 128 quantizes act in its epilogue);
# the FP8 row is the best the sweep found, still 1.2-1.4x slower than the aligned path, which FP8 experts keep.
SETTINGS = {False: parse_settings("n16k256w4s3", "n8k128w4s3"),
            True: parse_settings("n128k128w8s3", "n4k128w4s1")}


@triton.jit
def _slot_experts(ids, token, slots, num_routed, TOP_K: tl.constexpr):
    """Experts (int64) of a token's slots (a scalar or a vector): routed ids for slots < k, else the shared expert
    of that slot (past the last slot: ids past the stack, for masked loads only)."""
    shared = (num_routed + slots - TOP_K).to(tl.int64)
    if TOP_K == 0:
        expert = shared
    else:
        routed = slots < TOP_K
        expert = tl.where(routed, tl.load(ids + token * TOP_K + slots, mask=routed, other=0).to(tl.int64), shared)
    return expert


@triton.jit
def _fp8_rounded(v, ROWS: tl.constexpr):
    """[ROWS, 128] float32 quantized to e4m3 per row (`quant_groups`, as `per_token_group_quant` and moe_triton's
    gate_up epilogue quantize a group of 128) and scaled back: each value quant·scale, in float32."""
    quant, scale = quant_groups(v[:, None, :], E4M3_MAX)
    return tl.reshape(quant.to(tl.float32) * scale[:, :, None], (ROWS, 128))


@triton.jit(do_not_specialize=["num_routed"])  # never a compile-time 1: _slot_experts converts it
def _gate_up_kernel(x, ids, w, act, w_scale, act_scale, hidden, inter, num_routed,
                    SLOTS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    STAGES: tl.constexpr, FP8: tl.constexpr, ACT_FP8: tl.constexpr):
    """act[pair, col's block] = SiLU(x[token] @ gate[e]ᵀ) * (x[token] @ up[e]ᵀ). FP8 (BLOCK_K 128: a step is one
    group of x and one block of w, BLOCK_N ≤ 128 its rows): x quantized per 128 columns here, each product scaled by
    x's group scale and the weight block's (`w_scale` [E, 2I/128, H/128]); with ACT_FP8 act is written in e4m3
    with `act_scale` [pairs, I/128], else in float32."""
    pair = tl.program_id(0).to(tl.int64)
    token, slot = pair // SLOTS, pair % SLOTS
    expert = _slot_experts(ids, token, slot, num_routed, TOP_K)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    gate_rows = w + (expert * 2 * inter + offs_n)[:, None] * hidden  # [BN, 1]: rows of w viewed as [E * 2I, H]
    up_rows = gate_rows + inter * hidden
    h_groups = tl.cdiv(hidden, 128)
    i_groups = inter // 128  # FP8 needs I % 128 == 0
    gate_scales = w_scale + (expert * 2 * i_groups + n0 // 128) * h_groups
    up_scales = gate_scales + i_groups * h_groups
    # float32 products summed per column across the loop and across columns once after it (no reduction per step)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):  # STAGES > 1: loads issued STAGES - 1 steps ahead
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        a = tl.load(x + token * hidden + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        w_ok = n_ok[:, None] & k_ok[None, :]
        g = tl.load(gate_rows + offs_k[None, :], mask=w_ok, other=0.0).to(tl.float32)
        u = tl.load(up_rows + offs_k[None, :], mask=w_ok, other=0.0).to(tl.float32)
        if FP8:  # x's group quantized as per_token_group_quant does (columns past H: zeros)
            a = tl.reshape(_fp8_rounded(a[None, :], 1), (BLOCK_K,))
            a_g = a * tl.load(gate_scales + k0 // 128)
            a_u = a * tl.load(up_scales + k0 // 128)
        else:
            a_g, a_u = a, a
        acc_g += g * a_g[None, :]
        acc_u += u * a_u[None, :]
    gate, up = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    out = gate / (1.0 + tl.exp(-gate)) * up  # SiLU(gate) * up in float32, as moe_triton computes it
    if ACT_FP8:  # quantized per 128 columns (BLOCK_N is 128)
        quant, scale = quant_groups(tl.reshape(out, (1, BLOCK_N // 128, 128)), E4M3_MAX)
        tl.store(act + pair * inter + offs_n, tl.reshape(quant, (BLOCK_N,)), mask=n_ok)
        groups = tl.program_id(1) * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
        tl.store(act_scale + pair * i_groups + groups, tl.reshape(scale, (BLOCK_N // 128,)), mask=groups < i_groups)
    else:
        tl.store(act + pair * inter + offs_n, out.to(act.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["num_routed"])
def _down_sum_kernel(act, act_scale, ids, weights, w, w_scale, x, out, hidden, inter, num_routed,
                     TOP_K: tl.constexpr, SHARED: tl.constexpr, SLOTS_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr, FP8: tl.constexpr, ACT_FP8: tl.constexpr):
    """out[token, col's block] = Σ over the token's slots, slot 0 first, in float32, of weight·(act[pair] @
    down[e]ᵀ): a routed pair's row rounded to x's dtype first, a shared expert's (weight 1) kept float32. All the
    slots' rows stream together, one [SLOTS_P2, BLOCK_N, BLOCK_K] tile a step. FP8 (BLOCK_K 128, BLOCK_N ≤ 128: a
    step is one group of act and one block of w): act in e4m3 with `act_scale` (ACT_FP8) or float32 quantized here
    per 128 columns; each product scaled by act's group scale and the weight block's (`w_scale` [E, H/128, I/128])."""
    SLOTS: tl.constexpr = TOP_K + SHARED
    token = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    slots = tl.arange(0, SLOTS_P2)
    s_ok = slots < SLOTS
    experts = _slot_experts(ids, token, slots, num_routed, TOP_K)  # [S]
    pairs = token * SLOTS + slots
    rows = w + ((experts * hidden)[:, None] + offs_n[None, :])[:, :, None] * inter  # [S, BN, 1] of w as [E * H, I]
    row_ok = (s_ok[:, None] & n_ok[None, :])[:, :, None]
    acts = act + (pairs * inter)[:, None]  # [S, 1]
    i_groups = tl.cdiv(inter, 128)
    act_scales = act_scale + pairs * i_groups  # [S]
    w_scales = w_scale + (experts * tl.cdiv(hidden, 128) + n0 // 128) * i_groups
    acc = tl.zeros((SLOTS_P2, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, inter, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter
        a_ok = s_ok[:, None] & k_ok[None, :]
        a = tl.load(acts + offs_k[None, :], mask=a_ok, other=0.0).to(tl.float32)  # [S, BK]
        b = tl.load(rows + offs_k[None, None, :], mask=row_ok & k_ok[None, None, :], other=0.0).to(tl.float32)
        if FP8:
            if ACT_FP8:
                a = a * tl.load(act_scales + k0 // 128, mask=s_ok, other=0.0)[:, None]
            else:  # as gate_up's epilogue quantizes act in moe_triton
                a = _fp8_rounded(a, SLOTS_P2)
            a = a * tl.load(w_scales + k0 // 128, mask=s_ok, other=0.0)[:, None]
        acc += b * a[:, None, :]
    slot_rows = tl.sum(acc, axis=2)  # [S, BN] float32
    if TOP_K > 0:
        routed = slots < TOP_K
        weight = tl.load(weights + token * TOP_K + slots, mask=routed, other=0.0).to(tl.float32)
        rounded = (slot_rows * weight[:, None]).to(x.dtype.element_ty).to(tl.float32)
        slot_rows = tl.where(routed[:, None], rounded, slot_rows)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(SLOTS):  # one row at a time, slot 0 first (tl.sum over the slots: a tree's order)
        total += tl.sum(tl.where(slots[:, None] == slot, slot_rows, 0.0), axis=0)
    tl.store(out + token * hidden + offs_n, total.to(out.dtype.element_ty), mask=n_ok)


def check_settings(settings: dict, fp8: bool) -> dict:
    """Both kernels' `KNOBS`, checked: BLOCK_N, BLOCK_K, num_warps powers of two, num_stages 1-8; FP8: BLOCK_K 128
    (a step per scale block) and BLOCK_N at most 128 (one block of rows)."""
    for kernel in ("gate_up", "down"):
        cfg = settings.get(kernel)
        if not isinstance(cfg, dict) or set(cfg) != set(KNOBS):
            raise ValueError(f"small-path settings need gate_up and down, each with exactly {', '.join(KNOBS)}; "
                             f"got {settings!r}")
        if any(not isinstance(value, int) or value < 1 for value in cfg.values()):
            raise ValueError(f"small-path {kernel} settings must be positive integers; got {cfg}")
        if any(cfg[key] & (cfg[key] - 1) for key in KNOBS[:3]) or cfg["num_stages"] > 8:
            raise ValueError(f"small-path {kernel} BLOCK_N, BLOCK_K and num_warps must be powers of two, num_stages "
                             f"1-8; got {cfg}")
        if fp8 and (cfg["BLOCK_K"] != GROUP or cfg["BLOCK_N"] > GROUP):
            raise ValueError(f"FP8 small-path {kernel} BLOCK_K must be {GROUP} and BLOCK_N at most {GROUP} (a step "
                             f"takes one block of the weights' scales); got {cfg}")
    return settings


def experts_small(x, weights, ids, gate_up, down, num_shared: int = 0, sum_dtype=None, gate_up_scale=None,
                  down_scale=None, settings: dict | None = None) -> torch.Tensor:
    """`moe.experts_triton`'s result (same arguments, same rounding) for up to `MAX_TOKENS` tokens in two launches.
    `settings` replaces the kernels' settings from `SETTINGS` (the benchmark's variants: `parse_settings`)."""
    tokens, top_k = ids.shape
    num_experts, hidden, inter = down.shape
    if tokens > MAX_TOKENS:
        raise ValueError(f"the small-token MoE path takes at most {MAX_TOKENS} tokens, got {tokens}: "
                         "use the aligned path (moe.experts_triton with AFD_MOE_SMALL_TOKENS below the count)")
    if x.shape != (tokens, hidden) or weights.shape != ids.shape or gate_up.shape != (num_experts, 2 * inter, hidden):
        raise ValueError(f"experts_small: x {tuple(x.shape)}, weights {tuple(weights.shape)}, ids {tuple(ids.shape)}, "
                         f"gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}: want x [T, H], weights and ids "
                         "[T, k], gate_up [E, 2I, H], down [E, H, I]")
    if not 0 <= num_shared <= num_experts:
        raise ValueError(f"{num_shared} shared experts of {num_experts}")
    fp8 = check_fp8(gate_up, down, gate_up_scale, down_scale)
    cfg = check_settings(settings or SETTINGS[fp8], fp8)
    out_dtype = sum_dtype or x.dtype
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=x.device)
    if not tokens:
        return out
    slots = top_k + num_shared
    if not slots:
        return out.zero_()
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    if not top_k:  # unread (the kernels take no routed slot): any tensor of the device
        ids = weights = x
    up_cfg, down_cfg = cfg["gate_up"], cfg["down"]
    act_fp8 = fp8 and up_cfg["BLOCK_N"] % GROUP == 0
    act_dtype = FP8 if act_fp8 else torch.float32 if fp8 else x.dtype
    act = torch.empty(tokens * slots, inter, dtype=act_dtype, device=x.device)
    act_scale = torch.empty(tokens * slots, inter // GROUP, dtype=torch.float32, device=x.device) if act_fp8 else act
    w_scales = (gate_up_scale, down_scale) if fp8 else (act, act)  # unread placeholders without FP8
    num_routed = num_experts - num_shared
    _gate_up_kernel[(tokens * slots, triton.cdiv(inter, up_cfg["BLOCK_N"]))](
        x, ids, gate_up, act, w_scales[0], act_scale, hidden, inter, num_routed, SLOTS=slots, TOP_K=top_k,
        BLOCK_N=up_cfg["BLOCK_N"], BLOCK_K=up_cfg["BLOCK_K"], STAGES=up_cfg["num_stages"], FP8=fp8, ACT_FP8=act_fp8,
        num_warps=up_cfg["num_warps"], num_stages=up_cfg["num_stages"])
    _down_sum_kernel[(tokens, triton.cdiv(hidden, down_cfg["BLOCK_N"]))](
        act, act_scale, ids, weights, down, w_scales[1], x, out, hidden, inter, num_routed, TOP_K=top_k,
        SHARED=num_shared, SLOTS_P2=triton.next_power_of_2(slots), BLOCK_N=down_cfg["BLOCK_N"],
        BLOCK_K=down_cfg["BLOCK_K"], STAGES=down_cfg["num_stages"], FP8=fp8, ACT_FP8=act_fp8,
        num_warps=down_cfg["num_warps"], num_stages=down_cfg["num_stages"])
    return out
