"""How many KV-cache tokens fit on a GPU, from a profiled step rather than an estimate.

As vLLM does: before the KV cache exists, run the largest step a rank can be asked for and
read the allocator's peak. The cache then takes `gpu_memory_utilization` of the device,
less what is in use (weights, CUDA context, NCCL buffers), less that peak, less a margin
for the decode graphs' pool. Memory is read through a `DeviceMemory`, so this is tested on
CPU with a fake one.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from afd.kv_cache import DEFAULT_BLOCK_SIZE

GRAPH_MARGIN_BYTES = 1 << 30  # the decode graphs' pool (captured after the cache) and allocator fragmentation
# the piecewise prompt-step graphs' share of that pool, per token of their largest bucket (afd.graphs.mixed:
# 0.95 GiB at 2,048 tokens at DeepSeek-V2-Lite shapes on an H200, bench/mixed_step.py)
MIXED_GRAPH_BYTES_PER_TOKEN = 512 << 10


def graph_margin_bytes(mixed_graph_tokens: int) -> int:
    """Device memory kept out of the KV cache for graphs captured after it."""
    return GRAPH_MARGIN_BYTES + mixed_graph_tokens * MIXED_GRAPH_BYTES_PER_TOKEN


class DeviceMemory(Protocol):
    """What sizing reads of one device's memory, in bytes."""

    def free_and_total(self) -> tuple[int, int]: ...

    def allocated(self) -> int: ...

    def reset_peak(self) -> None: ...

    def peak(self) -> int: ...

    def release_cached(self) -> None: ...


@dataclass(frozen=True)
class CudaMemory:
    """`DeviceMemory` of one CUDA device, from torch's caching allocator."""

    device: torch.device

    def free_and_total(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def release_cached(self) -> None:
        """Give the blocks the allocator keeps back to the device, so `free_and_total` sees them free."""
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()


def profile_peak(run: Callable[[], None], memory: DeviceMemory) -> int:
    """Bytes `run` had allocated at its peak beyond what was allocated before it."""
    memory.release_cached()
    memory.reset_peak()
    before = memory.allocated()
    run()
    peak = memory.peak() - before
    memory.release_cached()
    return max(0, peak)


@dataclass(frozen=True)
class KVBudget:
    """A KV-cache size and what it was derived from (logged at start)."""

    tokens: int
    total_bytes: int
    in_use_bytes: int
    activation_bytes: int
    margin_bytes: int


def plan_kv_budget(memory: DeviceMemory, utilization: float, activation_bytes: int, bytes_per_token: int,
                   margin_bytes: int = GRAPH_MARGIN_BYTES) -> KVBudget:
    """Tokens that fit in `utilization` of the device, less what is in use, the profiled peak and the margin."""
    free, total = memory.free_and_total()
    in_use = total - free
    budget = int(utilization * total) - in_use - activation_bytes - margin_bytes
    if budget < bytes_per_token * DEFAULT_BLOCK_SIZE * 2:
        raise RuntimeError(
            f"no room for a KV cache: {utilization:.2f} of {total / 2**30:.1f} GiB is {utilization * total / 2**30:.1f} GiB, "
            f"{in_use / 2**30:.1f} GiB are in use, the largest step peaked at {activation_bytes / 2**30:.1f} GiB and "
            f"{margin_bytes / 2**30:.1f} GiB are kept for the graphs (raise gpu_memory_utilization, lower "
            f"max_num_batched_tokens, max_num_seqs or mixed_graph_tokens, or set kv_cache_bytes)")
    return KVBudget(budget // bytes_per_token, total, in_use, activation_bytes, margin_bytes)
