"""Tensors as data-plane frames: raw bytes whose shape and dtype travel in the header."""

from __future__ import annotations

import torch

from afd.connector.wire import ProtocolError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def to_frame(tensor: torch.Tensor) -> memoryview:
    """A CPU byte view of `tensor` (copied off the device when needed)."""
    data = tensor.detach().contiguous()
    if data.device.type != "cpu":
        data = data.cpu()
    return memoryview(data.view(torch.uint8).reshape(-1).numpy())


def from_frame(frame: bytes, rows: int, cols: int, dtype_name: str, device: torch.device | str) -> torch.Tensor:
    """Bytes → [rows, cols] tensor on `device`; a size that does not match is a `ProtocolError`."""
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise ProtocolError(f"unknown dtype {dtype_name!r}")
    if rows < 0 or cols < 0:
        raise ProtocolError(f"tensor frame header says {rows}x{cols}: a negative size")
    expected = rows * cols * torch.empty(0, dtype=dtype).element_size()
    if len(frame) != expected:
        raise ProtocolError(f"tensor frame has {len(frame)} bytes, header says {rows}x{cols} {dtype_name} = {expected}")
    if expected == 0:
        return torch.empty(rows, cols, dtype=dtype, device=device)
    data = torch.frombuffer(bytearray(frame), dtype=torch.uint8).view(dtype).view(rows, cols)
    return data.to(device)


def pack_rows(hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[T, H] hidden and [T, E] float32 logits as one [T, bytes] uint8 tensor: one message per transfer."""
    return torch.cat((hidden.contiguous().view(torch.uint8), logits.float().contiguous().view(torch.uint8)), dim=1)


def packed_width(hidden_size: int, dtype: torch.dtype, logit_cols: int) -> int:
    """Bytes per row of `pack_rows`: the hidden row, then the float32 logits."""
    return hidden_size * dtype.itemsize + 4 * logit_cols


def unpack_rows(packed: torch.Tensor, hidden_size: int, dtype: torch.dtype, logit_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_rows`: views (no copy) of the hidden rows and the float32 logits."""
    split = hidden_size * dtype.itemsize
    if packed.shape[1] != packed_width(hidden_size, dtype, logit_cols) or split % 4:
        raise ProtocolError(f"packed rows of {packed.shape[1]} bytes do not hold {hidden_size} x {dtype} + {logit_cols} x float32")
    return packed[:, :split].view(dtype), packed[:, split:].view(torch.float32)
