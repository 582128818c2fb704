"""The MoE layer for a few tokens (a decode step of batch 1–4): two GEMV kernels, no alignment, no slot sum.

At one token the aligned path (`moe_align` + `moe_triton`'s two GEMMs + `moe_rows.sum_slots`, + the activations'
quantization for FP8) spends more on its 4–5 launches than on streaming the experts (issue 33). Here:

- `gate_up`: one program per (pair, column block), pair p = token·(k+S) + slot as in `moe_align` (the S shared
  experts are experts num_routed.. in the last slots); it reads its expert id from `ids`, streams x[token]
  against that expert's gate and up rows and writes SiLU(gate)·up for the pair.
- `down`: one program per (token, column block); it loops over the token's k+S slots and sums
  weight·(act @ down[e]ᵀ) in float32, slot 0 first: a routed pair's weighted row rounded to x's dtype first,
  a shared expert's kept in float32 — the rounding `moe_triton._down_job` + `moe_rows.sum_slots` do — and
  stores the sum in `sum_dtype`.

FP8 experts (e4m3 stacks, 128×128 block scales): `gate_up` quantizes x[token] per 128 columns itself, as
`fp8_gemm.per_token_group_quant` does, and scales each 128-column product by both groups' scales as
`moe_triton` does; act is quantized per 128 columns as `moe_triton`'s gate_up epilogue does — in `gate_up` when
its column block is a multiple of 128 (act in e4m3 with its scales), else in `down` as it reads act (kept in
float32 between the two: the same values, and a narrower gate_up column block). Every shape follows from the
token count: capturable in CUDA graphs. `moe.experts_triton` takes this path up to `AFD_MOE_SMALL_TOKENS` tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd.kernels.fp8_blocks import check_fp8
from afd.kernels.fp8_gemm import FP8, FP8_MAX, GROUP, quant_groups

E4M3_MAX = tl.constexpr(FP8_MAX)  # a kernel reads only constexpr globals
MAX_TOKENS = 16  # the most tokens this path takes: every pair streams its expert on its own (no tiles)

# BLOCK_N columns per program and BLOCK_K inputs per step of each kernel (FP8: BLOCK_K a multiple of 128), chosen
# without a GPU measurement (bench/moe_small.py times them): narrow column blocks, so that one token still gives
# hundreds of programs to stream the experts; FP8's gate_up block of 128 quantizes act in its epilogue
SETTINGS = {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4},
            "down": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4}}
FP8_SETTINGS = {"gate_up": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8},
                "down": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4}}


@triton.jit
def _slot_expert(ids, token, slot, num_routed, TOP_K: tl.constexpr):
    """Expert (int64) of a token's slot: its routed id for slots < k, else the shared expert of that slot."""
    shared = (num_routed + slot - TOP_K).to(tl.int64)
    if TOP_K == 0:
        expert = shared
    else:
        routed = slot < TOP_K
        expert = tl.where(routed, tl.load(ids + token * TOP_K + slot, mask=routed, other=0).to(tl.int64), shared)
    return expert


@triton.jit
def _group_products(w, v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BN, BK/128]: each row of `w` ([BN, BK]) times `v` ([BK]), summed per 128 inputs (float32)."""
    return tl.sum(tl.reshape(w * v[None, :], (BLOCK_N, BLOCK_K // 128, 128)), axis=2)


@triton.jit(do_not_specialize=["num_routed"])  # never a compile-time 1: _slot_expert converts it
def _gate_up_kernel(x, ids, w, act, w_scale, act_scale, hidden, inter, num_routed,
                    SLOTS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    FP8: tl.constexpr, ACT_FP8: tl.constexpr):
    """act[pair, col's block] = SiLU(x[token] @ gate[e]ᵀ) * (x[token] @ up[e]ᵀ). FP8: x quantized per 128 columns
    here, each group's product times x's group scale and the weight block's (`w_scale` [E, 2I/128, H/128]); with
    ACT_FP8 act is written in e4m3 with `act_scale` [pairs, I/128], else in float32."""
    pair = tl.program_id(0).to(tl.int64)
    token, slot = pair // SLOTS, pair % SLOTS
    expert = _slot_expert(ids, token, slot, num_routed, TOP_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    gate_rows = expert * 2 * inter + offs_n  # rows of w viewed as [E * 2I, H]
    h_groups = tl.cdiv(hidden, 128)
    i_groups = inter // 128  # FP8 needs I % 128 == 0
    gate_scale_rows = (expert * 2 * i_groups + offs_n // 128) * h_groups
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        a = tl.load(x + token * hidden + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        w_ok = n_ok[:, None] & k_ok[None, :]
        g = tl.load(w + gate_rows[:, None] * hidden + offs_k[None, :], mask=w_ok, other=0.0).to(tl.float32)
        u = tl.load(w + (gate_rows + inter)[:, None] * hidden + offs_k[None, :], mask=w_ok, other=0.0).to(tl.float32)
        if FP8:  # x's groups of 128 quantized as per_token_group_quant does (columns past H: zeros)
            quant, a_s = quant_groups(tl.reshape(a, (1, BLOCK_K // 128, 128)), E4M3_MAX)
            a_q = tl.reshape(quant.to(tl.float32), (BLOCK_K,))
            groups = k0 // 128 + tl.arange(0, BLOCK_K // 128)
            s_ok = n_ok[:, None] & (groups < h_groups)[None, :]
            g_s = tl.load(w_scale + gate_scale_rows[:, None] + groups[None, :], mask=s_ok, other=0.0)
            u_s = tl.load(w_scale + (gate_scale_rows + i_groups * h_groups)[:, None] + groups[None, :], mask=s_ok,
                          other=0.0)
            acc_g += tl.sum(_group_products(g, a_q, BLOCK_N, BLOCK_K) * (a_s * g_s), axis=1)
            acc_u += tl.sum(_group_products(u, a_q, BLOCK_N, BLOCK_K) * (a_s * u_s), axis=1)
        else:
            acc_g += tl.sum(g * a[None, :], axis=1)
            acc_u += tl.sum(u * a[None, :], axis=1)
    out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # SiLU(gate) * up in float32, as moe_triton computes it
    if ACT_FP8:  # quantized per 128 columns (BLOCK_N is a multiple of 128)
        quant, scale = quant_groups(tl.reshape(out, (1, BLOCK_N // 128, 128)), E4M3_MAX)
        tl.store(act + pair * inter + offs_n, tl.reshape(quant, (BLOCK_N,)), mask=n_ok)
        groups = tl.program_id(1) * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
        tl.store(act_scale + pair * i_groups + groups, tl.reshape(scale, (BLOCK_N // 128,)), mask=groups < i_groups)
    else:
        tl.store(act + pair * inter + offs_n, out.to(act.dtype.element_ty), mask=n_ok)


@triton.jit(do_not_specialize=["num_routed"])
def _down_sum_kernel(act, act_scale, ids, weights, w, w_scale, x, out, hidden, inter, num_routed,
                     TOP_K: tl.constexpr, SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     FP8: tl.constexpr, ACT_FP8: tl.constexpr):
    """out[token, col's block] = Σ over the token's slots, slot 0 first, in float32, of weight·(act[pair] @
    down[e]ᵀ): a routed pair's row rounded to x's dtype first, a shared expert's (weight 1) kept float32. FP8:
    act in e4m3 with `act_scale` (ACT_FP8) or float32 quantized here per 128 columns; each group's product
    times act's group scale and the weight block's (`w_scale` [E, H/128, I/128])."""
    SLOTS: tl.constexpr = TOP_K + SHARED
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    h_groups = tl.cdiv(hidden, 128)
    i_groups = tl.cdiv(inter, 128)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(SLOTS):
        pair = token * SLOTS + slot
        expert = _slot_expert(ids, token, slot, num_routed, TOP_K)
        rows = expert * hidden + offs_n  # rows of w viewed as [E * H, I]
        scale_rows = (expert * h_groups + offs_n // 128) * i_groups
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < inter
            a = tl.load(act + pair * inter + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            b = tl.load(w + rows[:, None] * inter + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            if FP8:
                groups = k0 // 128 + tl.arange(0, BLOCK_K // 128)
                g_ok = groups < i_groups
                if ACT_FP8:
                    a_s = tl.load(act_scale + pair * i_groups + groups, mask=g_ok, other=0.0)
                else:  # as gate_up's epilogue quantizes act in moe_triton
                    quant, scales = quant_groups(tl.reshape(a, (1, BLOCK_K // 128, 128)), E4M3_MAX)
                    a = tl.reshape(quant.to(tl.float32), (BLOCK_K,))
                    a_s = tl.reshape(scales, (BLOCK_K // 128,))
                b_s = tl.load(w_scale + scale_rows[:, None] + groups[None, :], mask=n_ok[:, None] & g_ok[None, :],
                              other=0.0)
                acc += tl.sum(_group_products(b, a, BLOCK_N, BLOCK_K) * (a_s[None, :] * b_s), axis=1)
            else:
                acc += tl.sum(b * a[None, :], axis=1)
        if slot < TOP_K:
            weight = tl.load(weights + token * TOP_K + slot).to(tl.float32)
            total += (acc * weight).to(x.dtype.element_ty).to(tl.float32)
        else:
            total += acc
    tl.store(out + token * hidden + offs_n, total.to(out.dtype.element_ty), mask=n_ok)


def check_settings(settings: dict, fp8: bool) -> dict:
    """Both kernels' BLOCK_N, BLOCK_K (powers of two; FP8: BLOCK_K a multiple of 128) and num_warps, checked."""
    for kernel in ("gate_up", "down"):
        cfg = settings.get(kernel)
        if not isinstance(cfg, dict) or set(cfg) != {"BLOCK_N", "BLOCK_K", "num_warps"}:
            raise ValueError(f"small-path settings need gate_up and down, each with exactly BLOCK_N, BLOCK_K and "
                             f"num_warps; got {settings!r}")
        if any(not isinstance(cfg[key], int) or cfg[key] < 1 or cfg[key] & (cfg[key] - 1) for key in cfg):
            raise ValueError(f"small-path {kernel} settings must be powers of two; got {cfg}")
        if fp8 and cfg["BLOCK_K"] % GROUP:
            raise ValueError(f"FP8 small-path {kernel} BLOCK_K must be a multiple of {GROUP}; got {cfg['BLOCK_K']}")
    return settings


def experts_small(x, weights, ids, gate_up, down, num_shared: int = 0, sum_dtype=None, gate_up_scale=None,
                  down_scale=None, settings: dict | None = None) -> torch.Tensor:
    """`moe.experts_triton`'s result (same arguments, same rounding) for up to `MAX_TOKENS` tokens in two launches.
    `settings` replaces the kernels' block sizes (`SETTINGS`/`FP8_SETTINGS`: the benchmark's variants)."""
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
    cfg = check_settings(settings or (FP8_SETTINGS if fp8 else SETTINGS), fp8)
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
        BLOCK_N=up_cfg["BLOCK_N"], BLOCK_K=up_cfg["BLOCK_K"], FP8=fp8, ACT_FP8=act_fp8,
        num_warps=up_cfg["num_warps"])
    _down_sum_kernel[(tokens, triton.cdiv(hidden, down_cfg["BLOCK_N"]))](
        act, act_scale, ids, weights, down, w_scales[1], x, out, hidden, inter, num_routed, TOP_K=top_k,
        SHARED=num_shared, BLOCK_N=down_cfg["BLOCK_N"], BLOCK_K=down_cfg["BLOCK_K"], FP8=fp8, ACT_FP8=act_fp8,
        num_warps=down_cfg["num_warps"])
    return out
