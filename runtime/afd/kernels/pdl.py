"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's Triton kernels (issue 33, batch 1).

A one-token decode step is a chain of some 15 small kernels a layer, and between two of them the GPU idles: the
next grid is launched only once the last block of the one before has drained, then ramps up. Launched with PDL,
a kernel is started while the one before it still runs; its first act is `gdc_wait`, which blocks until that
kernel has finished and its writes are visible, so every read and write of the kernel comes after it (safe
whatever kernel came before, cuBLAS included), and its second is `gdc_launch_dependents`, which lets the kernel
after it start in turn. Graph capture keeps these as programmatic edges.

Off unless `AFD_PDL=true` (and on compute capability 9.0 and later): `bench/pdl_chain.py` and
`bench/step_floor.py` measure it first. A kernel takes the constexpr `GDC` (default off: the interpreter and
older GPUs never see the instructions) and calls `gdc_enter(GDC)` first; its launch passes `**launch_options(device)`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from afd.config import process_setting

_OFF: dict = {}
_ON = {"GDC": True, "launch_pdl": True}


@triton.jit
def gdc_enter(GDC: tl.constexpr):
    """First thing in a kernel: wait for the kernel before (PDL), then let the one after start."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a launch on `device`: `GDC` and `launch_pdl` where PDL is on, else none."""
    return _ON if device.type == "cuda" and _enabled(device.index if device.index is not None else -1) else _OFF


@functools.lru_cache(maxsize=None)
def _enabled(index: int) -> bool:
    if not process_setting("AFD_PDL"):
        return False
    index = torch.cuda.current_device() if index < 0 else index
    return torch.cuda.get_device_capability(index)[0] >= 9
