"""Loaded MoE layers made ready for the fused kernels (`afd.kernels.moe`): shared experts folded
in as extra experts, every tuned kernel compiled before serving."""

from __future__ import annotations

import torch

from afd.kernels.moe import device_table
from afd.models.layers import MoE


def fuse_shared_experts(moe) -> None:
    """Fold `moe.shared_experts` (width n·I) into `moe.experts` as n extra experts; frees the MLP."""
    shared, experts = moe.shared_experts, moe.experts
    if shared is None or experts is None:
        return
    inter = experts.down.shape[2]
    width = shared.down_proj.weight.shape[1]
    if width % inter or shared.gate_proj.bias is not None:
        return  # not expressible as whole experts: keep the separate MLP
    count = width // inter
    gate = shared.gate_proj.weight.view(count, inter, -1)  # [n, I, H]
    up = shared.up_proj.weight.view(count, inter, -1)
    down = shared.down_proj.weight.view(-1, count, inter).transpose(0, 1)  # [n, H, I]
    with torch.no_grad():  # both new tensors before either old one is freed (see below)
        gate_up = torch.cat((experts.gate_up, torch.cat((gate, up), 1)))
        down = torch.cat((experts.down, down.contiguous()))
    experts.gate_up = torch.nn.Parameter(gate_up, requires_grad=False)
    experts.down = torch.nn.Parameter(down, requires_grad=False)
    experts.num_shared = count
    moe.shared_experts = None
    if gate_up.is_cuda:
        # hand the old tensors' segments back now: left cached, the next layer's tensors would be carved out of
        # them and pin the rest, which no KV cache could use (9 GiB at DeepSeek-V2-Lite shapes, issue 33)
        torch.cuda.empty_cache()


def warm_up(model: torch.nn.Module) -> int:
    """Compile and load the MoE kernels of every tuned token count before serving.

    A kernel's first launch compiles it (seconds, longer than a peer waits for a step)
    and loads its module, which may wait for kernels already running: with NCCL
    transfers in flight that could stall both ends. Returns the number of sizes run.
    """
    moe = next((m for m in model.modules() if isinstance(m, MoE) and m.experts is not None), None)
    if moe is None or not moe.experts.gate_up.is_cuda or moe.experts.gate_up.dtype not in (torch.bfloat16, torch.float16):
        return 0
    experts = moe.experts
    num_experts, hidden, inter = experts.down.shape
    device = experts.down.device
    sizes = sorted(device_table(device, num_experts, hidden, inter))
    with torch.inference_mode():
        for tokens in sizes:
            x = torch.zeros(tokens, hidden, dtype=experts.down.dtype, device=device)
            logits = torch.randn(tokens, moe.routing.num_experts, device=device)
            moe.from_logits(x, logits)
    torch.cuda.synchronize(device)
    return len(sizes)
