"""Which quantized checkpoints we serve, and the FP8 layout of a model that keeps its weights FP8.

Served: FP8 block quantization as DeepSeek-V3 and Qwen3-*-FP8 publish it (`quant_method: fp8`,
e4m3, `weight_block_size: [128, 128]`, a float `weight_scale_inv` per block, activations
quantized dynamically). Any other `quantization_config` is refused by name. Which tensors are
FP8 is read from the files (a weight with a `weight_scale_inv` beside it), so
`modules_to_not_convert` is honoured by construction; a listed module whose weight is FP8 in the
files contradicts it and is refused.

On a GPU the weights stay FP8 (`convert_to_fp8`): each linear layer whose weight is FP8 in the
checkpoint becomes an `Fp8Linear`, and routed-expert stacks hold float8 `gate_up`/`down` with
`gate_up_scale`/`down_scale`. Exceptions, dequantized at load instead: MLA's `kv_b_proj` (absorbed
decode multiplies by its per-head slices), a stack whose width is not a multiple of the block
(gate and up scales could not be stacked), and an expert-parallel slice of a shared expert
that does not start and end on a block edge.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from afd.kernels.fp8_blocks import BLOCK, FP8_DTYPE, scale_shape
from afd.models.fp8 import Fp8Linear
from afd.models.layers import Experts
from afd.models.spec import UnsupportedModelError

log = logging.getLogger(__name__)
SCALE_SUFFIX = "_scale_inv"  # weight → weight_scale_inv
_KNOWN_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"}
_SERVED = "FP8 block quantization (quant_method fp8, fmt e4m3, weight_block_size [128, 128], activation_scheme dynamic)"
DEQUANTIZED_ALWAYS = ("kv_b_proj",)  # module names (last part) kept in the compute dtype even on a GPU


@dataclass(frozen=True)
class Fp8Format:
    """A served FP8 checkpoint's settings."""

    block: int = BLOCK
    not_converted: tuple[str, ...] = ()


def parse_quantization(config: dict) -> Fp8Format | None:
    """The checkpoint's FP8 format, None for an unquantized one; UnsupportedModelError names anything else."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise UnsupportedModelError(f"quantization_config={quant!r}: expected an object")
    method = quant.get("quant_method")
    if method != "fp8":
        raise UnsupportedModelError(f"quantization_config.quant_method={method!r} is not supported; served: {_SERVED}")
    unknown = sorted(set(quant) - _KNOWN_KEYS)
    if unknown:
        raise UnsupportedModelError(f"quantization_config has settings this runtime does not honour: "
                                    f"{', '.join(unknown)}; served: {_SERVED}")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedModelError(f"quantization_config.fmt={quant['fmt']!r} is not supported; served: {_SERVED}")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedModelError(f"quantization_config.activation_scheme={quant['activation_scheme']!r} (static "
                                    f"activation scales) is not supported; served: {_SERVED}")
    block = quant.get("weight_block_size")
    if block is None:
        raise UnsupportedModelError(f"quantization_config without weight_block_size (per-tensor FP8) is not supported; "
                                    f"served: {_SERVED}")
    if list(block) != [BLOCK, BLOCK]:
        raise UnsupportedModelError(f"quantization_config.weight_block_size={list(block)} is not supported; "
                                    f"served: {_SERVED}")
    modules = quant.get("modules_to_not_convert") or []
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise UnsupportedModelError(f"quantization_config.modules_to_not_convert={modules!r}: expected a list of names")
    return Fp8Format(BLOCK, tuple(modules))


def check_fp8_tensors(fmt: Fp8Format | None, keys: list[str], dtypes: dict[str, str]) -> None:
    """The checkpoint's tensors agree with its quantization_config: every FP8 weight has its scale, FP8 tensors
    only under an FP8 config, none in a module the config keeps unconverted. `dtypes`: key → safetensors dtype."""
    fp8 = [key for key in keys if dtypes.get(key) == "F8_E4M3"]
    if fp8 and fmt is None:
        raise UnsupportedModelError(f"tensor {fp8[0]} is float8 but config.json has no quantization_config")
    present = set(keys)
    for key in fp8:
        if key + SCALE_SUFFIX not in present:
            raise UnsupportedModelError(f"tensor {key} is float8 without {key + SCALE_SUFFIX}: not block-quantized")
        module = key.rsplit(".", 1)[0]
        for name in fmt.not_converted:
            if module == name or module.startswith(name + ".") or module.endswith("." + name):
                raise UnsupportedModelError(f"tensor {key} is float8 although quantization_config."
                                            f"modules_to_not_convert lists {name!r}")


def convert_to_fp8(model: nn.Module, is_fp8, block: int = BLOCK) -> None:
    """Give `model` (built, pruned, sharded, on any device, typically meta) FP8 storage where the checkpoint
    has it: `is_fp8(weight_name)` says whether a weight is FP8 with a scale in the files."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Experts):
            _convert_experts(name, module, is_fp8, block)
            continue
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and child_name not in DEQUANTIZED_ALWAYS and is_fp8(f"{full}.weight") \
                    and _block_aligned_slice(module, block):
                fp8 = Fp8Linear(child.in_features, child.out_features, child.bias is not None,
                                device=child.weight.device, dtype=child.weight.dtype, block=block)
                setattr(module, child_name, fp8)


def _block_aligned_slice(module: nn.Module, block: int) -> bool:
    """An expert-parallel column slice of a shared expert (`shard_columns`) keeps FP8 only on block edges."""
    columns = getattr(module, "shard_columns", None)
    return columns is None or all(edge % block == 0 for edge in columns)


def _convert_experts(name: str, experts: nn.Module, is_fp8, block: int) -> None:
    count, hidden, width = experts.down.shape
    first = experts.first
    keys = [f"{name}.{e}.{proj}.weight" for e in range(first, first + count)
            for proj in ("gate_proj", "up_proj", "down_proj")]
    if not all(is_fp8(key) for key in keys):
        return
    if width % block:
        log.info("%s: expert width %d is not a multiple of the %d-column FP8 block; dequantized at load", name, width,
                 block)
        return
    device = experts.down.device
    experts.gate_up = nn.Parameter(torch.empty(count, 2 * width, hidden, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
    experts.down = nn.Parameter(torch.empty(count, hidden, width, dtype=FP8_DTYPE, device=device), requires_grad=False)
    experts.gate_up_scale = torch.empty(count, *scale_shape(2 * width, hidden, block), device=device)
    experts.down_scale = torch.empty(count, *scale_shape(hidden, width, block), device=device)


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer `model` holds (weights, FP8 scales, norms, biases)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
