"""Rotary position embeddings: default and YaRN frequencies, cos/sin of positions (and a per-setting table for
the fused rotary kernel, `afd.kernels.norm_rope`), and RoPE applied in either family's dimension layout."""

from __future__ import annotations

import json
import math

import torch


def rope_inv_freq(rope: dict, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of `dim` rotary dims and the attention factor, for default or YaRN RoPE."""
    base = float(rope.get("rope_theta", 10000.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type != "yarn":
        raise ValueError(f"rope_type={rope_type!r} is not supported (supported: default, yarn)")
    factor = float(rope["factor"])
    original_len = rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = math.floor(correction_dim(beta_fast)), math.ceil(correction_dim(beta_slow))
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = (inv_freq / factor) * ramp + inv_freq * (1 - ramp)  # interpolate the low frequencies
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


_ROPE_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # Rotary.table's, per setting and device


class Rotary:
    """cos/sin of token positions for one RoPE setting; frequencies computed once, on first use."""

    def __init__(self, rope: dict, dim: int, max_positions: int = 0):
        self.rope, self.dim = rope, dim
        self.max_positions = max_positions  # rows of `table`; 0: no table
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._inv_freq: torch.Tensor | None = None  # never a parameter: nothing to load
        self.factor = 1.0

    def table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin [P, dim/2] of every position below `max_positions`, by `rope_cos_sin` itself (the rotary
        kernel's input), shared by every layer of one setting; None where that kernel cannot use one."""
        half = self.dim // 2
        if not self.max_positions or self.dim % 2 or half & (half - 1):
            return None
        if self._table is not None and self._table[0].device == device:  # the step's hot path: no key built
            return self._table
        key = (json.dumps(self.rope, sort_keys=True, default=str), self.dim, self.max_positions, str(device))
        if key not in _ROPE_TABLES:
            inv_freq, factor = rope_inv_freq(self.rope, self.dim)
            _ROPE_TABLES[key] = rope_cos_sin(inv_freq.to(device), torch.arange(self.max_positions, device=device), factor)
        self._table = _ROPE_TABLES[key]
        return self._table

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq is None:
            inv_freq, self.factor = rope_inv_freq(self.rope, self.dim)
            if positions.is_cuda:  # pinned and asynchronous: the host must not wait on the stream mid-step
                inv_freq = inv_freq.pin_memory()
            self._inv_freq = inv_freq.to(positions.device, non_blocking=True)
        return rope_cos_sin(self._inv_freq, positions, self.factor)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of `positions` × `inv_freq`, both scaled by the attention factor: [T, dim/2]."""
    angles = positions.float().unsqueeze(-1) * inv_freq
    return torch.cos(angles) * factor, torch.sin(angles) * factor


def apply_rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [T, heads, dim] pairing dim i with i + dim/2 (Llama/Qwen layout)."""
    cos, sin = cos.repeat(1, 2).unsqueeze(1), sin.repeat(1, 2).unsqueeze(1)
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [T, heads, dim] pairing dims (2i, 2i+1) (the DeepSeek layout)."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)
