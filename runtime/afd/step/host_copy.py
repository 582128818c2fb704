"""Host tensors to a device without waiting for it."""

from __future__ import annotations

import torch


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device`; to a GPU through pinned memory, so the host does not wait for the stream
    (a copy from pageable memory waits for every kernel queued before it)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
