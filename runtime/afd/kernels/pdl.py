"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's Triton kernels (issue 33, batch 1).

A one-token decode step is a chain of some 15 small kernels a layer, and between two of them the GPU idles: the
next grid is launched only once the last block of the one before has drained, then ramps up. Launched with PDL,
a kernel is started while the one before it still runs; its first act is `gdc_wait`, which blocks until that
kernel has finished and its writes are visible, so every read and write of the kernel comes after it (safe
whatever kernel came before, cuBLAS included), and its second is `gdc_launch_dependents`, which lets the kernel
after it start in turn. Graph capture keeps these as programmatic edges.

A GEMM does not let the next kernel start early (`release_early=False`: it waits, and the next one starts as its
last blocks exit): with every kernel releasing early, the monolith's batch-1 step was 15 % slower on the H200
(session 44: the profiler showed the MoE down and row-sum kernels' time doubled, their blocks resident and waiting
while the GEMM before them ran).

Measured (bench/RESULTS.md, issue 33, session 44): a chain of 64 one-token GEMVs in a graph, 4.09 µs a link plain,
3.42 with early release (H200); but a whole decode step gains only on the attention-only step at batch 1 (0.92-0.94x)
and loses on the monolith even with GEMMs only waiting (1.07x, H100), so it stays off by default.

Off unless `AFD_PDL=true` (and on compute capability 9.0 and later): `bench/kernels/pdl_chain.py` and
`bench/step/step_floor.py --pdl off,on` measure it. A kernel takes the constexpr `GDC` (0, the default: off, so the
interpreter and older GPUs never see the instructions; 1: wait; 2: wait, then release the next kernel) and calls
`gdc_enter(GDC)` first; its launch passes `**launch_options(device)`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from afd.config import process_setting

_OFF: dict = {}
_WAIT = {"GDC": 1, "launch_pdl": True}
_RELEASE = {"GDC": 2, "launch_pdl": True}


@triton.jit
def gdc_enter(GDC: tl.constexpr):
    """First thing in a kernel: wait for the kernel before (PDL, GDC >= 1), then let the one after start (GDC 2)."""
    if GDC >= 1:
        tl.extra.cuda.gdc_wait()
    if GDC >= 2:
        tl.extra.cuda.gdc_launch_dependents()


def launch_options(device: torch.device, release_early: bool = True) -> dict:
    """Keyword arguments for a launch on `device`: `GDC` and `launch_pdl` where PDL is on, else none."""
    if device.type != "cuda" or not enabled(device.index if device.index is not None else -1):
        return _OFF
    return _RELEASE if release_early else _WAIT


@functools.lru_cache(maxsize=None)
def enabled(index: int) -> bool:
    """PDL on for device `index` (-1: the current one): `AFD_PDL` and compute capability 9.0 or later; cached, so a
    caller that changes `AFD_PDL` clears it (`enabled.cache_clear()`)."""
    if not process_setting("AFD_PDL"):
        return False
    index = torch.cuda.current_device() if index < 0 else index
    return torch.cuda.get_device_capability(index)[0] >= 9
