"""Where the Triton kernel tests run: on a CUDA GPU, or on the CPU in Triton's interpreter
(TRITON_INTERPRET=1 set before Triton is imported, with Triton installed); elsewhere they skip."""

from __future__ import annotations

import importlib.util
import os

import torch

NO_KERNEL_DEVICE = "needs a CUDA GPU or TRITON_INTERPRET=1 with Triton installed"
KERNEL_DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float16}  # the interpreter has no bfloat16 dots


def kernel_device() -> str | None:
    """"cuda", "cpu" (the interpreter) or None."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
        return "cpu"
    return None


class LaunchRecorder:
    """Stands in for a Triton kernel (`kernel[grid](*args, **constants)`): runs nothing, appends each launch's
    keyword arguments (its compile-time constants and launch options) to `launched[name]`."""

    def __init__(self, launched: dict[str, list[dict]], name: str):
        self.launched, self.name = launched, name

    def __getitem__(self, grid):
        return lambda *args, **constants: self.launched.setdefault(self.name, []).append(constants)
