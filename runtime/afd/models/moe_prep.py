"""Loaded MoE layers made ready for the fused kernels (`afd.kernels.moe`): shared experts folded
in as extra experts (an expert-parallel shard's slice of narrower width as a stack of its own,
`afd.models.shared_stack`), every tuned kernel compiled before serving."""

from __future__ import annotations

import torch

from afd.kernels.moe import device_table
from afd.models.layers import MoE
from afd.models.shared_stack import SharedStack, stackable


def fuse_shared_experts(moe) -> None:
    """Fold `moe.shared_experts` (width n·I) into `moe.experts` as n extra experts; frees the MLP. FP8 experts
    take FP8 shared projections (`Fp8Linear`) with their block scales; a mix of formats stays apart. An
    expert-parallel shard's slice that is not whole experts (a shard returns float32 partials) runs as a
    `SharedStack` through the same kernels, so that it rounds as the unsharded rank's folded expert does."""
    shared, experts = moe.shared_experts, moe.experts
    if shared is None or experts is None or not hasattr(shared, "down_proj"):
        return
    inter = experts.down.shape[2]
    width = shared.down_proj.weight.shape[1]
    fp8 = experts.gate_up_scale is not None
    if width % inter or shared.gate_proj.bias is not None or fp8 != hasattr(shared.down_proj, "weight_scale_inv"):
        if experts.partial_fp32 and stackable(shared):
            with torch.no_grad():
                moe.shared_experts = stack = SharedStack(*_as_experts(shared, 1))
            del shared  # the MLP's gate and up weights go now (the stack holds them concatenated)
            _release(stack.gate_up)
        return  # else not expressible as whole experts of the same format: keep the separate MLP
    count = width // inter
    with torch.no_grad():  # both new tensors before either old one is freed (see below)
        gate_up, down, gate_up_scale, down_scale = _as_experts(shared, count)
        gate_up, down = torch.cat((experts.gate_up, gate_up)), torch.cat((experts.down, down))
        if fp8:
            experts.gate_up_scale = torch.cat((experts.gate_up_scale, gate_up_scale))
            experts.down_scale = torch.cat((experts.down_scale, down_scale))
    experts.gate_up = torch.nn.Parameter(gate_up, requires_grad=False)
    experts.down = torch.nn.Parameter(down, requires_grad=False)
    experts.num_shared = count
    moe.shared_experts = None
    _release(gate_up)


def _release(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        # hand the old tensors' segments back now: left cached, the next layer's tensors would be carved out of
        # them and pin the rest, which no KV cache could use (9 GiB at DeepSeek-V2-Lite shapes, issue 33)
        torch.cuda.empty_cache()


def _as_experts(mlp, count: int) -> tuple:
    """A SwiGLU MLP of width n·I as n experts' stacks: (gate_up [n, 2I, H], down [n, H, I], and for FP8 their block
    scales [n, 2I/128, H/128] and [n, H/128, I/128], cut the same way; else None, None)."""
    gate_up = _rows(mlp.gate_proj.weight, mlp.up_proj.weight, count)
    down = _columns(mlp.down_proj.weight, count)
    if not hasattr(mlp.down_proj, "weight_scale_inv"):
        return gate_up, down, None, None
    return (gate_up, down, _rows(mlp.gate_proj.weight_scale_inv, mlp.up_proj.weight_scale_inv, count),
            _columns(mlp.down_proj.weight_scale_inv, count))


def _rows(gate: torch.Tensor, up: torch.Tensor, count: int) -> torch.Tensor:
    """[n·R, C] gate and up → [n, 2R, C]: each of n experts' gate rows then its up rows (R whole scale blocks
    for FP8)."""
    return torch.cat((gate.view(count, -1, gate.shape[1]), up.view(count, -1, up.shape[1])), 1)


def _columns(matrix: torch.Tensor, count: int) -> torch.Tensor:
    """[R, n·C] → [n, R, C] (contiguous): a projection's column blocks as n experts'."""
    return matrix.view(matrix.shape[0], count, -1).transpose(0, 1).contiguous()


def warm_up(model: torch.nn.Module) -> int:
    """Compile and load the MoE kernels of every tuned token count before serving.

    A kernel's first launch compiles it (seconds, longer than a peer waits for a step)
    and loads its module, which may wait for kernels already running: with NCCL
    transfers in flight that could stall both ends. Returns the number of sizes run.
    """
    moe = next((m for m in model.modules() if isinstance(m, MoE) and m.experts is not None), None)
    if moe is None or not moe.experts.gate_up.is_cuda:
        return 0
    experts = moe.experts
    fp8 = experts.gate_up_scale is not None
    dtype = _compute_dtype(model) if fp8 else experts.down.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return 0
    num_experts, hidden, inter = experts.down.shape
    device = experts.down.device
    sizes = sorted(device_table(device, num_experts, hidden, inter, fp8))
    with torch.inference_mode():
        for tokens in sizes:
            x = torch.zeros(tokens, hidden, dtype=dtype, device=device)
            logits = torch.randn(tokens, moe.routing.num_experts, device=device)
            moe.from_logits(x, logits)
    torch.cuda.synchronize(device)
    return len(sizes)


def _compute_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the activations beside FP8 weights: the model's first bf16/fp16 parameter or buffer's."""
    tensors = (*model.parameters(), *model.buffers())
    return next((t.dtype for t in tensors if t.dtype in (torch.bfloat16, torch.float16)), None)
