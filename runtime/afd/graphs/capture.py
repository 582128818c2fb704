"""Capturing and replaying steps: real CUDA graphs in one shared pool, or an eager stand-in.

`GraphPool.capture(fn)` returns something with `.replay()`. On CUDA it records `fn` into a
`torch.cuda.CUDAGraph` that shares one memory pool with every other graph of the pool;
`EagerPool` (CPU tests) keeps `fn` and calls it on replay, so the static-buffer logic
around graphs is exercised without a GPU.
"""

from __future__ import annotations

from typing import Callable

import torch


class EagerPool:
    """A stand-in that 'captures' by remembering the function."""

    memory_bytes = 0

    class _Replay:
        def __init__(self, fn: Callable[[], None]):
            self.fn = fn

        def replay(self) -> None:
            self.fn()

    def capture(self, fn: Callable[[], None]) -> "EagerPool._Replay":
        return self._Replay(fn)


class GraphPool:
    """CUDA graphs captured into one memory pool; `memory_bytes` is what capturing took."""

    def __init__(self, device: torch.device):
        self.device = device
        self.handle = torch.cuda.graph_pool_handle()
        self.memory_bytes = 0

    def capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: NCCL pairs are created and torn down on helper threads (afd.connector.transports.nccl.attention),
        # whose allocations must not invalidate a capture running on this one
        with torch.cuda.graph(graph, pool=self.handle, capture_error_mode="thread_local"):
            fn()
        torch.cuda.synchronize(self.device)
        self.memory_bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        return graph


def make_pool(device: torch.device):
    return GraphPool(device) if device.type == "cuda" else EagerPool()
