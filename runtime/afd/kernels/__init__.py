"""GPU kernels: a sync-free fused MoE and paged decode attention (Triton), with torch fallbacks.

Nothing here imports Triton at module import time; CPU-only installs never touch it.
"""

import functools


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether Triton imports here (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401  # local import: optional; this probes whether it is installed

        return True
    except ImportError:
        return False
