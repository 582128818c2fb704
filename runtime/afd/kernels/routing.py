"""Top-k routing in one Triton kernel: softmax or sigmoid, (group-limited) top-k, renormalise or scale, cast.

`afd.models.layers.Routing.select` does the same in torch with six to eight launches
(softmax, topk, sum, divide, multiply, cast), which at 1 to 4,096 tokens cost more than the
arithmetic: each program here takes a block of tokens, holds their logits in registers and
writes the k weights and expert ids. Experts come out in descending weight, the lowest
expert id first among equal weights; a row whose logits hold a NaN still gets k distinct,
valid expert ids (with NaN weights, as torch gives), never an id that would index past the
experts. Capturable in CUDA graphs (no host synchronisation).

`select_noaux_tc` is DeepSeek-V3's router (`Routing.noaux_tc` in torch): sigmoid scores, the
correction bias added for choosing only, experts chosen among the `topk_groups` groups whose two
best biased scores sum highest, weights the chosen experts' unbiased scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd.kernels.pdl import gdc_enter, launch_options

MAX_EXPERTS = 512  # one program holds a token's logits in registers
MAX_SPLITS = 64  # split-K partials of the logits, added by one unrolled loop (as skinny_gemm.MAX_SPLITS)


NAN_RANK = tl.constexpr(-2.0e38)  # a NaN score ranks after every real one (sigmoid + bias may be negative)
OUT_OF_GROUP_RANK = tl.constexpr(-3.0e38)  # experts of groups not kept: after NaN ones, before padding/picked (-inf)


@triton.jit
def _group_mask(choice, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, GROUPS: tl.constexpr,
                TOPK_GROUPS: tl.constexpr):
    """[BT, E] bool: whether each expert's group is among the TOPK_GROUPS groups (of E/GROUPS consecutive
    experts) whose two best `choice` values sum highest (the lowest group first among equal sums)."""
    SIZE: tl.constexpr = BLOCK_E // GROUPS
    grouped = tl.reshape(tl.where(choice == choice, choice, NAN_RANK), (BLOCK_T, GROUPS, SIZE))
    best = tl.max(grouped, axis=2)
    score = best
    if SIZE > 1:
        pos = tl.arange(0, SIZE)[None, None, :]
        first = tl.min(tl.where(grouped == best[:, :, None], pos, SIZE), axis=2)
        score = best + tl.max(tl.where(pos == first[:, :, None], float("-inf"), grouped), axis=2)
    groups = tl.arange(0, GROUPS)[None, :]
    keep = tl.zeros((BLOCK_T, GROUPS), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUPS):
        top = tl.max(score, axis=1)
        top_id = tl.min(tl.where(score == top[:, None], groups, GROUPS), axis=1)
        hit = groups == top_id[:, None]
        keep = tl.where(hit, 1, keep)
        score = tl.where(hit, float("-inf"), score)
    return tl.reshape(tl.broadcast_to(keep[:, :, None], (BLOCK_T, GROUPS, SIZE)), (BLOCK_T, BLOCK_E)) != 0


@triton.jit
def _load_splits(at, split_stride, live, SPLITS: tl.constexpr):
    """The float32 logits at `at`: the sum of SPLITS split-K partials `split_stride` apart, in split order (as
    `skinny_gemm.sum_partials` and the skinny GEMM's own sum add them)."""
    total = tl.load(at, mask=live, other=0.0).to(tl.float32)
    for split in tl.static_range(1, SPLITS):
        total += tl.load(at + split * split_stride, mask=live, other=0.0).to(tl.float32)
    return total


@triton.jit(do_not_specialize=["num_tokens"])
def _select_kernel(logits_ptr, weights_ptr, ids_ptr, bias_ptr, num_tokens, num_experts, stride, split_stride, scaling,
                   TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                   NORMALIZE: tl.constexpr, SCALE: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                   GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, PARTS: tl.constexpr, SPLITS: tl.constexpr,
                   GDC: tl.constexpr = 0):
    gdc_enter(GDC)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    expert_ok = experts[None, :] < num_experts
    at = logits_ptr + rows[:, None].to(tl.int64) * stride + experts[None, :]
    live = row_ok[:, None] & expert_ok
    logits = _load_splits(at, split_stride, live, SPLITS)
    if PARTS == 3:  # split_linear's three column blocks: high + (middle + low), as `split_linear.sum_parts` adds
        middle = _load_splits(at + num_experts, split_stride, live, SPLITS)
        low = _load_splits(at + 2 * num_experts, split_stride, live, SPLITS)
        logits = logits + (middle + low)
    logits = tl.where(expert_ok, logits, float("-inf"))
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
        choice = scores
        if HAS_BIAS:  # for choosing only
            choice = scores + tl.load(bias_ptr + experts, mask=experts < num_experts, other=0.0).to(tl.float32)[None, :]
    else:
        shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = shifted / tl.sum(shifted, axis=1)[:, None]  # softmax (NaN where the logits hold one)
        choice = scores
    # the rank to pick by: padding and picked experts never again, NaN scores after every real one
    rank = tl.where(expert_ok, tl.where(choice == choice, choice, NAN_RANK), float("-inf"))
    if GROUPS > 1:
        rank = tl.where(_group_mask(choice, BLOCK_T, BLOCK_E, GROUPS, TOPK_GROUPS), rank, OUT_OF_GROUP_RANK)
    # the k picks go to columns 0..k-1 of tensors shaped as the logits: no layout conversion (a shared-memory
    # round trip and barrier) per pick, which cost most of the kernel's time at decode batches
    top = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    top_ids = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(rank, axis=1)
        best_id = tl.min(tl.where(rank == best[:, None], experts[None, :], BLOCK_E), axis=1)
        best_id = tl.minimum(best_id, num_experts - 1)  # an id past the experts would index out of bounds later
        picked = experts[None, :] == best_id[:, None]
        weight = tl.sum(tl.where(picked, scores, 0.0), axis=1)  # the (unbiased) score itself: NaN stays NaN
        top = tl.where(experts[None, :] == k, weight[:, None], top)
        top_ids = tl.where(experts[None, :] == k, best_id[:, None], top_ids)
        rank = tl.where(picked, float("-inf"), rank)
    if NORMALIZE:
        top = top / (tl.sum(top, axis=1)[:, None] + 1e-20)
    if SCALE:
        top = top * scaling
    out = rows[:, None].to(tl.int64) * TOP_K + experts[None, :]
    keep = row_ok[:, None] & (experts[None, :] < TOP_K)
    tl.store(weights_ptr + out, top.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + out, top_ids.to(ids_ptr.dtype.element_ty), mask=keep)


def select_greedy(logits: torch.Tensor, top_k: int, normalize: bool, scale: bool, scaling_factor: float,
                  dtype: torch.dtype, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits (any float dtype, read as float32) → ([T, k] weights in `dtype`, [T, k] int64 expert ids):
    softmax in float32, the k largest scores, divided by their sum when `normalize`, times `scaling_factor` when
    `scale`. `parts` 3: the logits come as split_linear's [T, 3E] blocks, summed here (no launch of their own);
    [S, T, parts·E]: as S split-K partials (`skinny_gemm.linear_partials`), added here in split order."""
    num_experts = logits.shape[-1] // parts
    if num_experts > MAX_EXPERTS or top_k > num_experts:
        raise ValueError(f"select_greedy takes up to {MAX_EXPERTS} experts and top_k <= experts; "
                         f"got {num_experts} experts, top_k {top_k}")
    return _launch_select(logits, None, top_k, normalize, scale, scaling_factor, dtype, sigmoid=False, parts=parts)


def noaux_tc_fits(num_experts: int, top_k: int, num_groups: int, topk_groups: int) -> bool:
    """Whether `select_noaux_tc` takes this router: up to MAX_EXPERTS experts and, with groups, a power-of-two
    expert count split into a power-of-two number of groups, of which topk_groups are kept."""
    if num_experts > MAX_EXPERTS or not 0 < top_k <= num_experts:
        return False
    if num_groups <= 1:
        return True
    power_of_two = num_experts & (num_experts - 1) == 0 and num_groups & (num_groups - 1) == 0
    return power_of_two and num_experts % num_groups == 0 and 0 < topk_groups <= num_groups


def select_noaux_tc(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, num_groups: int,
                    topk_groups: int, normalize: bool, scaling_factor: float,
                    dtype: torch.dtype, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits → ([T, k] weights in `dtype`, [T, k] int64 ids) as DeepSeek-V3 routes: sigmoid scores in
    float32, `correction_bias` [E] added for choosing only, the choice limited to the `topk_groups` best of
    `num_groups` groups (by the sum of each group's two best biased scores), the k best biased experts weighted
    by their unbiased scores, divided by their sum when `normalize`, times `scaling_factor` (`parts` as in
    `select_greedy`)."""
    num_experts = logits.shape[-1] // parts
    if not noaux_tc_fits(num_experts, top_k, num_groups, topk_groups):
        raise ValueError(f"select_noaux_tc takes up to {MAX_EXPERTS} experts, 0 < top_k <= experts and, with "
                         f"groups, power-of-two expert and group counts; got {num_experts} experts, top_k {top_k}, "
                         f"{num_groups} groups keeping {topk_groups}")
    return _launch_select(logits, correction_bias, top_k, normalize, True, scaling_factor, dtype, sigmoid=True,
                          groups=max(1, num_groups), topk_groups=max(1, topk_groups), parts=parts)


def _launch_select(logits, correction_bias, top_k: int, normalize: bool, scale: bool, scaling_factor: float,
                   dtype: torch.dtype, sigmoid: bool, groups: int = 1, topk_groups: int = 1, parts: int = 1):
    """One launch of `_select_kernel` over [T, parts·E] logits, or [S, T, parts·E] split-K partials of them
    (`skinny_gemm.linear_partials`, added here): ([T, k] weights in `dtype`, [T, k] int64 ids)."""
    if parts not in (1, 3) or logits.shape[-1] % parts:
        raise ValueError(f"routing logits come whole or in 3 split_linear blocks; got {parts} parts of {logits.shape[-1]}")
    if logits.dim() == 2:
        logits = logits.unsqueeze(0)
    if logits.dim() != 3 or not 1 <= logits.shape[0] <= MAX_SPLITS:
        raise ValueError(f"routing logits are [T, E] or [S <= {MAX_SPLITS}, T, E] partials; "
                         f"got {tuple(logits.shape)}")
    tokens, num_experts = logits.shape[1], logits.shape[2] // parts
    logits = logits if logits.stride(2) == 1 else logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    block_e = triton.next_power_of_2(num_experts)
    # one token and one warp a program: the k max/min reductions stay inside the warp (no shared memory, no barrier)
    # over a few logits a thread. 1,024 logits a warp (16-64 tokens) made each thread's serial chain 32 long: 8-10 us
    # a call at batch 1 on an H200 (bench/RESULTS.md, issue 33, session 40); a batch spreads over the multiprocessors
    block_t = 1
    if tokens:
        bias = correction_bias.contiguous() if correction_bias is not None else logits
        _select_kernel[(triton.cdiv(tokens, block_t),)](
            logits, weights, ids, bias, tokens, num_experts, logits.stride(1), logits.stride(0), float(scaling_factor),
            TOP_K=top_k,
            BLOCK_T=block_t, BLOCK_E=block_e, NORMALIZE=normalize, SCALE=scale,
            SIGMOID=sigmoid, HAS_BIAS=correction_bias is not None, GROUPS=groups, TOPK_GROUPS=topk_groups,
            PARTS=parts, SPLITS=logits.shape[0], num_warps=1, **launch_options(logits.device))
    return weights, ids
