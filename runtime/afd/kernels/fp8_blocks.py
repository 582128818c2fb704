"""FP8 block-quantized weights (the DeepSeek-V3 / Qwen3-FP8 checkpoint format), in pure torch.

A weight [out, in] is stored as float8_e4m3fn plus `weight_scale_inv` float32
[ceil(out/B), ceil(in/B)] (B = 128): the real weight is each B×B block's FP8 values times that
block's scale. The GEMM and MoE kernels read this format (`check_fp8`: an MoE's expert stacks in it);
`afd.models.fp8.Fp8Linear` holds it.
"""

from __future__ import annotations

import torch

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def scale_shape(rows: int, cols: int, block: int = BLOCK) -> tuple[int, int]:
    """Shape of the per-block scale of a [rows, cols] weight."""
    return -(-rows // block), -(-cols // block)


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    """[..., R, C] per-block values → [..., rows, cols], each block's value over its elements."""
    return scale.repeat_interleave(block, dim=-2)[..., :rows, :].repeat_interleave(block, dim=-1)[..., :cols]


def quantize_block_fp8(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] weight → (float8_e4m3fn weight, float32 scale_inv [..., ceil(out/B), ceil(in/B)]):
    each block scaled so its largest magnitude is the FP8 maximum (an all-zero block gets scale 1)."""
    rows, cols = w.shape[-2:]
    R, C = scale_shape(rows, cols, block)
    padded = w.float().new_zeros(*w.shape[:-2], R * block, C * block)
    padded[..., :rows, :cols] = w.float()
    blocks = padded.unflatten(-1, (C, block)).unflatten(-3, (R, block))  # [..., R, B, C, B]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., R, C]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = w.float() / _expand_blocks(scale_inv, rows, cols, block)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale_inv.contiguous()


def dequantize_block_fp8(w_fp8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                         block: int = BLOCK) -> torch.Tensor:
    """The real weight of an FP8 block-quantized one ([..., out, in] with [..., R, C] scales), in `dtype`."""
    rows, cols = w_fp8.shape[-2:]
    expected = scale_shape(rows, cols, block)
    if tuple(scale_inv.shape[-2:]) != expected:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not fit a {rows}x{cols} weight in "
                         f"{block}x{block} blocks (expected {expected})")
    return (w_fp8.float() * _expand_blocks(scale_inv.float(), rows, cols, block)).to(dtype)


def check_fp8(gate_up, down, gate_up_scale, down_scale) -> bool:
    """Whether MoE expert stacks (gate_up [E, 2I, H], down [E, H, I]) are FP8 (e4m3 with both block scales, of
    the shapes that fit them); a mix of FP8 and other weights, a missing scale or a misshapen one is an error
    naming it."""
    fp8 = gate_up.dtype == FP8_DTYPE
    if fp8 != (down.dtype == FP8_DTYPE) or fp8 != (gate_up_scale is not None) or fp8 != (down_scale is not None):
        raise ValueError(f"FP8 experts need e4m3 gate_up and down with both block scales; got gate_up {gate_up.dtype}, "
                         f"down {down.dtype}, gate_up_scale {'set' if gate_up_scale is not None else 'None'}, "
                         f"down_scale {'set' if down_scale is not None else 'None'}")
    if fp8:
        experts, hidden, inter = down.shape
        blocks = scale_shape(hidden, inter)
        if inter % BLOCK or gate_up_scale.shape != (experts, 2 * blocks[1], blocks[0]) or \
                down_scale.shape != (experts, *blocks):
            raise ValueError(f"FP8 experts [E={experts}, H={hidden}, I={inter}] need I % {BLOCK} == 0, gate_up_scale "
                             f"{(experts, 2 * blocks[1], blocks[0])} and down_scale {(experts, *blocks)}; got "
                             f"{tuple(gate_up_scale.shape)} and {tuple(down_scale.shape)}")
    return fp8
