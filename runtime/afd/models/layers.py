"""Building blocks shared by the model families: norms, fused projections, MLPs, routing, experts (RoPE:
`afd.models.rope`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from afd.kernels import split_linear, triton_available
from afd.kernels.fp8_blocks import dequantize_block_fp8
from afd.kernels.moe import experts_cuda, kernel_choice  # sync-free, capturable
# re-exported: deepseek_v2 and qwen3_moe import these from here
from afd.models.rope import Rotary, apply_rope_halves, apply_rope_pairs, yarn_mscale  # noqa: F401


class RMSNorm(nn.Module):
    """RMS norm computed in float32, scaled in the input dtype (as the HF families do)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_glue(x):  # one Triton launch instead of seven (afd.kernels.norm_rope)
            from afd.kernels.norm_rope import rms_norm  # local import: norm_rope imports Triton (CPU installs lack it)

            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, norm of it): one Triton launch where the glue is fused, else an add and `forward`."""
        if fused_glue(x) and residual.dtype == x.dtype:
            from afd.kernels.norm_rope import add_rms_norm  # local import: Triton (see forward)

            return add_rms_norm(x, residual, self.weight, self.eps)
        total = residual + x
        return total, self(total)


def fused_glue(x: torch.Tensor) -> bool:
    """Whether norms and rotary embeddings of `x` run as one Triton kernel each (`afd.kernels.norm_rope`)."""
    if not x.is_cuda or not triton_available():
        return False
    from afd.kernels.norm_rope import enabled  # local import: Triton, only once the device can run it

    return enabled(x)


def fuse_linears(*linears: nn.Module) -> torch.Tensor | None:
    """One weight [ΣN, K] holding the given Linears' weights as row blocks, each Linear's weight now a view of it,
    so that one GEMM computes every projection of the same input (`fused_linear`); None, with nothing changed,
    unless all are bias-free plain `nn.Linear`s of one dtype, device and input width (an Fp8Linear keeps its own
    block-scaled GEMM)."""
    if not linears or not all(type(linear) is nn.Linear and linear.bias is None for linear in linears):
        return None
    weights = [linear.weight.detach() for linear in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return None
    fused, start = torch.cat(weights), 0
    for linear, weight in zip(linears, weights):
        linear.weight.data = fused[start : start + weight.shape[0]]
        start += weight.shape[0]
    return fused


def fused_linear(x: torch.Tensor, fused: torch.Tensor | None, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """Each Linear of x: one GEMM with `fuse_linears`'s weight (outputs are column views of its result) while the
    Linears' weights are still its views on x's device; else one GEMM each."""
    if fused is None or fused.device != x.device or not _views_of(fused, linears):
        return tuple(linear(x) for linear in linears)
    out = cuda_linear(x, fused) if x.is_cuda else F.linear(x, fused)
    return out.split([linear.weight.shape[0] for linear in linears], dim=-1)


def cuda_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ weightᵀ of CUDA tensors, in `out_dtype` (None: x's; float32: from 16-bit inputs' accumulator) through
    `afd.kernels.skinny_gemm.linear`: its Triton kernel where this device's measured table picks it for these
    shapes (decode's few rows, issue 33), else torch's GEMM (F.linear, or torch.mm with a float32 output)."""
    if triton_available():
        from afd.kernels import skinny_gemm  # local import: the skinny GEMM imports Triton (CPU installs lack it)

        return skinny_gemm.linear(x, weight, out_dtype)
    return F.linear(x, weight) if out_dtype in (None, x.dtype) else torch.mm(x, weight.t(), out_dtype=out_dtype)


def apply_linear(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x); a bias-free plain nn.Linear of CUDA tensors through `cuda_linear` (o_proj in decode)."""
    if x.is_cuda and type(linear) is nn.Linear and linear.bias is None:
        return cuda_linear(x, linear.weight)
    return linear(x)


def _views_of(fused: torch.Tensor, linears) -> bool:
    """Whether the Linears' weights are still the row blocks of `fused` (a move or reload makes them copies)."""
    row_bytes, at = fused.stride(0) * fused.element_size(), fused.data_ptr()
    for linear in linears:
        if linear.weight.data_ptr() != at:
            return False
        at += linear.weight.shape[0] * row_bytes
    return True


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class Routing:
    """How router logits become (weights, expert ids); runs wherever the experts run."""

    top_k: int
    num_experts: int
    norm_topk_prob: bool = False
    scaling_factor: float = 1.0
    topk_method: str = "greedy"  # or "group_limited_greedy" (DeepSeek-V2), "noaux_tc" (DeepSeek-V3)
    num_groups: int = 1
    topk_groups: int = 1
    scale_when_normalized: bool = True  # DeepSeek-V2 scales only un-normalized weights

    def select(self, logits: torch.Tensor, dtype: torch.dtype,
               correction_bias: torch.Tensor | None = None, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, experts] logits → ([tokens, k] weights in `dtype`, [tokens, k] expert ids).
        Greedy routing on a GPU with the Triton MoE kernel runs as one Triton kernel (`afd.kernels.routing`).
        `correction_bias` [experts] (noaux_tc only) shifts the scores that choose experts, not their weights.
        `parts` 3: the logits are `Router.raw`'s split_linear blocks [tokens, 3·experts], summed by the kernel
        (or here, where the torch path runs); [S, tokens, parts·experts]: S split-K partials of them, likewise."""
        normalize = self.norm_topk_prob and self.top_k > 1
        if logits.is_cuda and kernel_choice() == "triton" and self.kernel_fits(logits.shape[-1] // parts):
            from afd.kernels import routing  # local import: the routing kernel imports Triton

            if self.topk_method == "noaux_tc":
                return routing.select_noaux_tc(logits, correction_bias, self.top_k, self.num_groups, self.topk_groups,
                                               self.norm_topk_prob, self.scaling_factor, dtype, parts)
            return routing.select_greedy(logits, self.top_k, normalize, not normalize or self.scale_when_normalized,
                                         self.scaling_factor, dtype, parts)
        if logits.dim() == 3:  # split-K partials (`Router.raw` on a GPU), added in split order
            from afd.kernels import skinny_gemm  # local import: Triton (only 3-D partials, from a GPU, come here)

            logits = skinny_gemm.sum_partials(logits)
        if parts != 1:
            logits = split_linear.sum_parts(logits)
        if self.topk_method == "noaux_tc":
            weights, ids = self.noaux_tc(logits, correction_bias)
            return weights.to(dtype), ids
        scale = not normalize or self.scale_when_normalized
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if self.topk_method == "group_limited_greedy":
            scores = self._mask_to_top_groups(scores)
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        if normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if scale:
            weights = weights * self.scaling_factor
        return weights.to(dtype), ids

    def kernel_fits(self, num_experts: int) -> bool:
        """Whether the routing kernel (`afd.kernels.routing`) takes this router over `num_experts` experts."""
        from afd.kernels import routing  # local import: the routing kernel imports Triton

        if self.topk_method == "noaux_tc":
            return routing.noaux_tc_fits(num_experts, self.top_k, self.num_groups, self.topk_groups)
        return self.topk_method == "greedy" and num_experts <= routing.MAX_EXPERTS

    def noaux_tc(self, logits: torch.Tensor, correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's router, the reference for the GPU kernel: sigmoid scores; experts chosen by score +
        bias among the `topk_groups` groups whose two best biased scores sum highest; weights are the chosen
        experts' unbiased scores, normalized if `norm_topk_prob`, always times `scaling_factor` (float32)."""
        scores = logits.float().sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if self.num_groups > 1:
            grouped = choice.view(choice.shape[0], self.num_groups, -1)  # [tokens, groups, experts/group]
            best_two = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            top_groups = best_two.topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(best_two, dtype=torch.bool).scatter_(1, top_groups, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(scores)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling_factor, ids

    def _mask_to_top_groups(self, scores: torch.Tensor) -> torch.Tensor:
        grouped = scores.view(scores.shape[0], self.num_groups, -1)  # [tokens, groups, experts/group]
        top_groups = grouped.max(dim=-1).values.topk(self.topk_groups, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0]).scatter_(1, top_groups, 1.0).bool()
        return grouped.masked_fill(~keep.unsqueeze(-1), 0.0).view_as(scores)


class Router(nn.Module):
    """The gate: hidden → router logits (float32 when `fp32_logits`, as DeepSeek does)."""

    def __init__(self, hidden: int, num_experts: int, fp32_logits: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.fp32_logits = fp32_logits
        self.weight_parts: torch.Tensor | None = None  # split_weight(): the float32 weight as 3 bf16 parts

    def split_weight(self) -> None:
        """Once the float32 weight is loaded: keep it also as three bf16 parts, so that bf16 inputs on a GPU get
        their float32 logits from one bf16 tensor-core GEMM (`afd.kernels.split_linear`)."""
        if self.fp32_logits and self.weight.dtype == torch.float32:
            self.weight_parts = split_linear.bf16_parts(self.weight.detach())

    def raw(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(logits as the routing takes them, parts): `forward`'s float32 logits, or split_linear's three float32
        column blocks unsummed (parts 3: `Routing.select` adds them in its kernel, no launch of their own); on a
        GPU where the skinny GEMM splits K, its [S, T, 3E] partials unsummed too (added by the routing kernel)."""
        if self.fp32_logits and self.weight_parts is not None and x.dtype == torch.bfloat16 and \
                x.device == self.weight_parts.device:
            if x.is_cuda and triton_available():
                from afd.kernels import skinny_gemm  # local import: Triton

                return skinny_gemm.linear_partials(x, self.weight_parts), 3
            return self._part_products(x), 3
        return self(x), 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp32_logits:
            if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2 and self.weight.dtype == x.dtype:
                # float32 straight from the GEMM's accumulator: one launch, no cast (issue 33); not rounded to
                # 16 bits first, so a little more exact than the checkpoint's own 16-bit router
                return cuda_linear(x, self.weight, torch.float32)
            return F.linear(x, self.weight).float()
        if self.weight_parts is not None and x.dtype == torch.bfloat16 and x.device == self.weight_parts.device:
            return split_linear.sum_parts(self._part_products(x))
        return F.linear(x.float(), self.weight.float())

    def _part_products(self, x: torch.Tensor) -> torch.Tensor:
        """`split_linear.part_products` of x and the weight's parts (on CUDA through `cuda_linear`: the same
        float32-output GEMM, or the skinny kernel where measured faster)."""
        if x.is_cuda:
            return cuda_linear(x, self.weight_parts, torch.float32)
        return split_linear.part_products(x, self.weight_parts)


class Experts(nn.Module):
    """Routed experts as stacked weights, computed with one sort and grouped GEMMs.

    Token→expert pairs are sorted by expert so each expert multiplies one contiguous
    block; there is no loop over tokens. On CUDA in bf16/fp16 the fused, sync-free
    kernels of `afd.kernels.moe` run; elsewhere each expert with rows is one matmul.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, first: int = 0):
        super().__init__()
        self.num_experts = num_experts
        self.first = first  # global id of expert 0 here: an expert-parallel shard holds [first, first + num_experts)
        self.partial_fp32 = False  # an expert-parallel shard sums its pairs in float32 (attention adds the partials)
        self.num_shared = 0  # shared experts folded in after loading (afd.models.moe_prep.fuse_shared_experts)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))  # [E, 2I, H]
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))  # [E, H, I]
        # FP8 weights kept FP8 (afd.models.quantization.convert_to_fp8): float32 scales per 128x128 block,
        # [E, 2I/128, ceil(H/128)] (gate's rows, then up's) and [E, ceil(H/128), ceil(I/128)]; None otherwise
        self.register_buffer("gate_up_scale", None)
        self.register_buffer("down_scale", None)

    def dense_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) in `dtype`: FP8 stacks dequantized, others as they are (the CPU path)."""
        if self.gate_up_scale is None:
            return self.gate_up, self.down
        return (dequantize_block_fp8(self.gate_up, self.gate_up_scale, dtype),
                dequantize_block_fp8(self.down, self.down_scale, dtype))

    def localize(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global (weights, ids) [T, k] → this shard's: other shards' experts get weight 0 and local id 0.

        Shapes stay those of the step (no data-dependent filtering), so a shard's step is
        capturable; the zero-weight pairs add exactly nothing to the partial sum.
        """
        local = ids - self.first
        inside = (local >= 0) & (local < self.num_experts)
        return weights * inside.to(weights.dtype), torch.where(inside, local, torch.zeros_like(local))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            sum_dtype = torch.float32 if self.partial_fp32 else None
            return experts_cuda(x, weights, ids, self.gate_up, self.down, self.num_shared, sum_dtype,
                                self.gate_up_scale, self.down_scale)
        top_k = ids.shape[1]
        flat_ids = ids.reshape(-1)  # [T*k]
        order = torch.argsort(flat_ids, stable=True)
        rows = order // top_k  # source token of each sorted pair
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        gate_up, down = self.dense_weights(x.dtype)
        hidden = _grouped_matmul(x.index_select(0, rows), counts, gate_up)  # [T*k, 2I]
        gate, up = hidden.chunk(2, dim=-1)
        out = _grouped_matmul(F.silu(gate) * up, counts, down)  # [T*k, H]
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        # each token's pairs summed in float32 and rounded once, as the CUDA kernels do
        total = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, rows, out.float())
        return total if self.partial_fp32 else total.to(x.dtype)


def _grouped_matmul(x: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of `x` grouped by expert (sizes `counts`) times each expert's `weight[e].T`."""
    pieces = [
        chunk @ weight[expert].T
        for expert, chunk in enumerate(x.split(counts.tolist()))
        if chunk.shape[0]
    ]
    return torch.cat(pieces) if pieces else x.new_zeros(0, weight.shape[1])


class MoE(nn.Module):
    """Routed experts plus optional shared experts, with a gate that may live elsewhere."""

    def __init__(self, hidden: int, routing: Routing, expert_width: int, shared_width: int, fp32_logits: bool):
        super().__init__()
        self.routing = routing
        self.gate: Router | None = Router(hidden, routing.num_experts, fp32_logits)
        self.experts: Experts | None = Experts(routing.num_experts, hidden, expert_width)
        self.shared_experts: GatedMLP | None = GatedMLP(hidden, shared_width) if shared_width else None
        # noaux_tc's per-expert score bias (checkpoint: mlp.gate.e_score_correction_bias); it chooses experts, so it
        # lives with the routing, on the experts' side, wherever the gate runs; float32 as transformers keeps it
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(routing.num_experts))
                                        if routing.topk_method == "noaux_tc" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_logits(x, *self.gate.raw(x))

    def from_logits(self, x: torch.Tensor, router_logits: torch.Tensor, parts: int = 1) -> torch.Tensor:
        """The expert half of the layer given router logits (shipped by attention or local; `parts` as
        `Routing.select` takes them)."""
        weights, ids = self.routing.select(router_logits, x.dtype, self.e_score_correction_bias, parts)
        if self.experts.num_experts != self.routing.num_experts:  # an expert-parallel shard: its experts only
            weights, ids = self.experts.localize(weights, ids)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
