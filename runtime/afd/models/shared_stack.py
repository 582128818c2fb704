"""An expert-parallel shard's slice of a shared expert, computed by the fused MoE kernels as the monolith's is.

On a GPU the unsharded rank folds its shared experts into the routed stack (`moe_prep.fuse_shared_experts`):
the fused kernels compute gate and up in float32, SiLU·up in float32 (rounded once to the activations' dtype,
or quantized per 128 columns from float32 for FP8) and down in float32. A shard holds a column slice of a shared
expert (`afd.models.expert_shard`); where that slice is not whole experts of the routed width (DeepSeek-V3's one
shared expert over 2+ shards) it could not be folded, and as a separate MLP it rounded gate, up, SiLU and their
product to bf16 and quantized down's input from those bf16 values (other FP8 scales, so other e4m3 values).
`SharedStack` runs the slice as a stack of one expert through the same kernels instead. The kernels keep a
shared expert's row in float32 until the token's sum (`afd.kernels.moe`), in the monolith as here, so the
slices' float32 outputs, added to the shards' float32 partial sums, make what the monolith adds up to the
order of float32 additions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afd.kernels.fp8_blocks import dequantize_block_fp8
from afd.kernels.moe import experts_cuda


class SharedStack(nn.Module):
    """A SwiGLU MLP of width W as one expert: `gate_up` [1, 2W, H], `down` [1, H, W] (FP8 with their block scales,
    or the activations' dtype). `forward` returns its output in float32."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                 down_scale: torch.Tensor | None = None):
        super().__init__()
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.register_buffer("gate_up_scale", gate_up_scale)
        self.register_buffer("down_scale", down_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            return self.kernels(x)
        gate_up, down = self.gate_up[0].float(), self.down[0].float()  # elsewhere: float32, dequantized weights
        if self.gate_up_scale is not None:
            gate_up = dequantize_block_fp8(self.gate_up[0], self.gate_up_scale[0])
            down = dequantize_block_fp8(self.down[0], self.down_scale[0])
        gate, up = (x.float() @ gate_up.T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ down.T

    def kernels(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] float32 by the fused MoE kernels (a GPU, or Triton's interpreter in tests): every token visits the
        one expert at weight 1, its pair row kept in float32."""
        none = torch.empty(x.shape[0], 0, dtype=torch.int64, device=x.device)  # no routed slot, one shared
        return experts_cuda(x, none.to(x.dtype), none, self.gate_up, self.down, 1, torch.float32,
                            self.gate_up_scale, self.down_scale)

    def extra_repr(self) -> str:
        return f"width={self.down.shape[2]}, hidden={self.down.shape[1]}, fp8={self.gate_up_scale is not None}"


def stackable(mlp: nn.Module, block: int = 128) -> bool:
    """Whether a SwiGLU MLP can run as a `SharedStack` (`afd.models.moe_prep.fuse_shared_experts` builds it): no
    biases, its three projections all FP8 or all plain, and a width of whole 128-column blocks (the FP8 kernels' activation groups; the monolith's groups too, so
    a slice on block edges quantizes the same columns together)."""
    projections = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if any(p is None or getattr(p, "bias", None) is not None for p in projections):
        return False
    fp8 = [hasattr(p, "weight_scale_inv") for p in projections]
    if len(set(fp8)) != 1 or (not fp8[0] and not all(type(p) is nn.Linear for p in projections)):
        return False
    return projections[0].weight.shape[0] % block == 0

