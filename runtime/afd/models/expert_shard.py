"""Expert parallelism as a transform: one FFN shard's part of every MLP, before any weight is read.

An FFN rank of G shards splits each layer's FFN so the G partial outputs sum to the whole:
routed experts by expert ([s·E/G, (s+1)·E/G), balanced when G does not divide E), shared
experts by intermediate column (a SwiGLU MLP is a sum over its columns; the down-projection
bias, if any, stays with shard 0). Dense MLP layers (a few, small next to the experts) run
whole on shard 0 and as zeros elsewhere, so their output is exactly the unsharded one. Every
shard keeps the norm and the router, which are small, so routing (top-k groups included) is
computed the same way on each. A shard sums its (token, expert) pairs in float32 and returns
that partial in float32; attention adds the partials and rounds once, so bf16 results match the
unsharded rank's (whose kernel also sums the pairs in float32 and rounds once; on a GPU a shared-expert
slice narrower than an expert runs through the same kernels, `afd.models.shared_stack`). No shard holds a
full copy of the routed experts; `shard_parts` tells the loader which slice of each checkpoint
tensor a parameter holds, so a shard reads only its own experts.
"""

from __future__ import annotations

import torch
from torch import nn

from afd.models.decoder import MoECausalLM
from afd.models.layers import Experts, GatedMLP, MoE
from afd.config.topology import shard_range


class ShardError(ValueError):
    """A model that cannot be split into the asked number of shards."""


def shard_ffn_model(model: MoECausalLM, shard: int, shards: int) -> None:
    """Keep shard `shard` of `shards` of every FFN module in `model` (built on the meta device)."""
    if shards == 1:
        return
    for layer in model.layers:
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            with torch.device(next(mlp.parameters()).device):  # the slices where the model is (meta: no bytes yet)
                _shard_moe(mlp, shard, shards)
        elif isinstance(mlp, GatedMLP) and shard != 0:
            layer.mlp = ZeroFFN()


def _shard_moe(mlp: MoE, shard: int, shards: int) -> None:
    if mlp.experts is not None:
        total = mlp.routing.num_experts
        if shards > total:
            raise ShardError(f"ffn_expert_parallel={shards} exceeds the model's {total} routed experts")
        start, stop = shard_range(total, shards, shard)
        _, hidden, inter = mlp.experts.down.shape
        mlp.experts = Experts(stop - start, hidden, inter, first=start)
        mlp.experts.partial_fp32 = True
    if mlp.shared_experts is not None:
        mlp.shared_experts = _column_slice(mlp.shared_experts, shard, shards)


class ZeroFFN(nn.Module):
    """A dense layer on shards other than 0: nothing to add ([tokens, hidden] float32 zeros)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)


def _column_slice(mlp: GatedMLP, shard: int, shards: int) -> GatedMLP:
    """Columns [start, stop) of a SwiGLU MLP: its output is this slice's share of the sum."""
    width = mlp.gate_proj.out_features
    start, stop = shard_range(width, shards, shard)
    part = GatedMLP(mlp.gate_proj.in_features, stop - start, bias=mlp.gate_proj.bias is not None)
    part.shard_columns = (start, stop)
    part.adds_bias = shard == 0  # the down-projection bias is added once, by shard 0
    return part


def shard_parts(model: nn.Module) -> dict[str, tuple[int, int, int] | None]:
    """Parameter name → (dim, start, stop) of the checkpoint tensor of the same name it holds (for
    stacked experts: the global expert ids); None for a parameter that must be zero (a bias another
    shard adds). Absent: the whole tensor."""
    parts: dict[str, tuple[int, int, int] | None] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, Experts) and module.first:  # rows [first, first + n) of the stacked experts
            for name in ("gate_up", "down"):
                parts[f"{prefix}.{name}"] = (0, module.first, module.first + module.num_experts)
        columns = getattr(module, "shard_columns", None)
        if columns is None:
            continue
        start, stop = columns
        for proj in ("gate_proj", "up_proj"):
            parts[f"{prefix}.{proj}.weight"] = (0, start, stop)
            parts[f"{prefix}.{proj}.bias"] = (0, start, stop)
        parts[f"{prefix}.down_proj.weight"] = (1, start, stop)
        if not module.adds_bias:
            parts[f"{prefix}.down_proj.bias"] = None
    return parts


def routed_expert_bytes(model: nn.Module) -> int:
    """Bytes of routed expert weights resident in `model` (shared experts folded in on a GPU excluded)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Experts):
            per_expert = (module.gate_up[0].numel() + module.down[0].numel()) * module.down.element_size()
            total += per_expert * module.num_experts
    return total
