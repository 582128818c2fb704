"""Building a role's model allocates each tensor once, in its final dtype (issue 33: the KV cache lost ~40 GB
to float32 weights converted one by one, which left the CUDA caching allocator's segments split)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from afd.models.checkpoint import Checkpoint
from afd.models.loader import build_share


class AllocatedBytes(TorchDispatchMode):
    """Bytes of every real (not meta) tensor an aten op returns while open."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                self.total += tensor.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize("arch", ["deepseek_v2", "qwen3_moe"])
def test_a_bf16_model_is_allocated_once_in_bf16(arch, checkpoints):
    config = Checkpoint(str(checkpoints[arch])).config
    with AllocatedBytes() as allocated:
        model, _, _ = build_share(config, "monolithic", False, torch.bfloat16, "cpu")
    held = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers()))
    assert {p.dtype for p in model.parameters()} <= {torch.bfloat16, torch.float32}
    assert allocated.total == held  # float32 first, then converted: 3x the bytes (1.5x of it transient)
