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

from afd.kv.cache import DEFAULT_BLOCK_SIZE

GRAPH_MARGIN_BYTES = 1 << 30  # the decode graphs' pool (captured after the cache) and allocator fragmentation
# the piecewise prompt-step graphs' share of that pool, per token of their largest bucket (afd.graphs.mixed:
# 0.95 GiB at 2,048 tokens at DeepSeek-V2-Lite shapes on an H200, bench/step/mixed_step.py)
MIXED_GRAPH_BYTES_PER_TOKEN = 512 << 10


def graph_margin_bytes(mixed_graph_tokens: int) -> int:
    """Device memory kept out of the KV cache for graphs captured after it."""
    return GRAPH_MARGIN_BYTES + mixed_graph_tokens * MIXED_GRAPH_BYTES_PER_TOKEN


class DeviceMemory(Protocol):
    """What sizing reads of one device's memory, in bytes."""

    def free_and_total(self) -> tuple[int, int]: ...

    def allocated(self) -> int: ...

    def reserved(self) -> int: ...

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

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

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
    """A KV-cache size and the device memory account it was derived from (logged at start).

    `in_use_bytes` = `allocated_bytes` (weights and buffers) + `held_bytes` (segments the caching allocator
    keeps but no tensor uses: fragments a KV tensor cannot take) + `other_bytes` (outside torch's allocator:
    CUDA context, NCCL, library workspaces).
    """

    tokens: int
    total_bytes: int
    in_use_bytes: int
    activation_bytes: int
    margin_bytes: int
    allocated_bytes: int = 0
    held_bytes: int = 0
    utilization: float = 0.0

    @property
    def other_bytes(self) -> int:
        return self.in_use_bytes - self.allocated_bytes - self.held_bytes

    def describe(self, bytes_per_token: int) -> str:
        """One log line: every part of the utilization budget in GiB."""
        gib = 2**30
        kv = self.tokens * bytes_per_token
        return (f"{self.tokens:,} tokens: {self.utilization:.2f} of {self.total_bytes / gib:.1f} GiB = "
                f"{self.allocated_bytes / gib:.2f} weights and buffers + {self.other_bytes / gib:.2f} outside torch "
                f"(CUDA context, NCCL, workspaces) + {self.held_bytes / gib:.2f} held unused by the allocator + "
                f"{self.activation_bytes / gib:.2f} activation peak + {self.margin_bytes / gib:.2f} graphs + "
                f"{kv / gib:.2f} KV cache")


def plan_kv_budget(memory: DeviceMemory, utilization: float, activation_bytes: int, bytes_per_token: int,
                   margin_bytes: int = GRAPH_MARGIN_BYTES) -> KVBudget:
    """Tokens that fit in `utilization` of the device, less what is in use, the profiled peak and the margin."""
    free, total = memory.free_and_total()
    return kv_budget_from(total, free, memory.allocated(), memory.reserved(), utilization, activation_bytes,
                          bytes_per_token, margin_bytes)


def kv_budget_from(total: int, free: int, allocated: int, reserved: int, utilization: float, activation_bytes: int,
                   bytes_per_token: int, margin_bytes: int) -> KVBudget:
    """`plan_kv_budget` on numbers read from the device (pure): the device's used bytes split into torch's
    allocations, what its allocator holds unused, and the rest."""
    if not 0 <= allocated <= reserved <= total - free:
        raise ValueError(f"inconsistent device memory: allocated {allocated} <= reserved {reserved} <= used "
                         f"{total - free} does not hold")
    in_use = total - free
    budget = int(utilization * total) - in_use - activation_bytes - margin_bytes
    if budget < bytes_per_token * DEFAULT_BLOCK_SIZE * 2:
        raise RuntimeError(
            f"no room for a KV cache: {utilization:.2f} of {total / 2**30:.1f} GiB is {utilization * total / 2**30:.1f} GiB, "
            f"{in_use / 2**30:.1f} GiB are in use, the largest step peaked at {activation_bytes / 2**30:.1f} GiB and "
            f"{margin_bytes / 2**30:.1f} GiB are kept for the graphs (raise gpu_memory_utilization, lower "
            f"max_num_batched_tokens, max_num_seqs or mixed_graph_tokens, or set kv_cache_bytes)")
    return KVBudget(budget // bytes_per_token, total, in_use, activation_bytes, margin_bytes, allocated,
                    reserved - allocated, utilization)
