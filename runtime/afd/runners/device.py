"""Device and dtype choice for a role process."""

from __future__ import annotations

import torch

from afd.config import AFDConfig
from afd.connector.tensors import DTYPES


def resolve_device(config: AFDConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but no CUDA device is visible to this process")
    return torch.device(config.device)


def resolve_dtype(config: AFDConfig, device: torch.device) -> str:
    """The dtype name both roles must agree on: bfloat16 on GPUs, float32 on CPUs by default."""
    if config.dtype != "auto":
        return config.dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]
