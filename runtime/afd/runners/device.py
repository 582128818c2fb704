"""Device and dtype choice for a role process."""

from __future__ import annotations

import torch

from afd.config import LoadSettings
from afd.connector.tensors import DTYPES


def resolve_device(load: LoadSettings) -> torch.device:
    if load.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if load.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but no CUDA device is visible to this process")
    return torch.device(load.device)


def resolve_dtype(load: LoadSettings, device: torch.device) -> str:
    """The dtype name both roles must agree on: bfloat16 on GPUs, float32 on CPUs by default."""
    if load.dtype != "auto":
        return load.dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]
