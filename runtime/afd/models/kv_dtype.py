"""The KV cache's element type (`kv_cache_dtype`): the model's own, or FP8 (e4m3) with a static per-tensor scale.

FP8 halves the cache's bytes a token, so nearly twice the sequences fit. The scale is vLLM's default without
calibration: one per tensor, 1.0, so quantizing is a saturating cast and dequantizing is the cast back. Every
reader then needs nothing beside the cache tensor (the paged decode kernels convert each row as they load it, the
prompt path casts the gathered rows); the values a cache holds are normed latents, normed keys (MLA, Qwen3) and
projections of normed states, within e4m3's range. MLA's rotary key goes in the same FP8 row as its latent: one
tensor, one row address for the kernels, 2× the tokens (a bf16 rotary part would keep 1.8×). Per-token dynamic
scales were the other choice: a scale tensor beside each block and one more load a row in every reader, and for
GQA's 128-wide heads a float32 scale a head and token leaves 1.94× the tokens, under issue 54's 1.95.

Torch only (the models layer: their attention writes the cache; `afd.kv` and the roles read the setting here).
The Triton kernels cast as `quantize` does.
"""

from __future__ import annotations

import torch

from afd.config import KV_CACHE_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448: the cast saturates here (e4m3fn has no infinity)
KV_SCALE = 1.0  # the static per-tensor scale: cache value = real value / KV_SCALE (the Triton kernels assume 1)


def cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the KV cache's tensors for the `kv_cache_dtype` setting: `auto` = the model's, `fp8` = e4m3."""
    if setting == "auto":
        return model_dtype
    if setting == "fp8":
        return FP8
    raise ValueError(f"kv_cache_dtype={setting!r}: must be one of {', '.join(KV_CACHE_DTYPES)}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8


def fused_store(cache: torch.dtype, row_dtype: torch.dtype) -> bool:
    """Whether the fused glue kernels (`afd.kernels.norm_rope`) write rows of `row_dtype` into a cache of
    `cache`: the same dtype, or FP8 (they saturate as `quantize` does)."""
    return cache == row_dtype or is_fp8(cache)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a cache of `dtype` stores it: for FP8 divided by the scale and saturated to ±448 (a cast alone would
    give NaN on CUDA past the range), else cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.float() / KV_SCALE).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def row_bytes(cache: torch.Tensor) -> torch.Tensor:
    """What to move whole cache rows through (index_select, index_copy_): FP8's bytes (torch has no indexed copies
    of float8 tensors), any other cache as it is."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def store_rows(cache: torch.Tensor, index: torch.Tensor, x: torch.Tensor) -> None:
    """cache[index] = x as the cache stores it (FP8 through byte views: an indexed write is defined for bytes on
    every device and torch version)."""
    if is_fp8(cache.dtype):
        row_bytes(cache)[index] = quantize(x, cache.dtype).view(torch.uint8)
    else:
        cache[index] = x.to(cache.dtype)
