"""Rewrite a checkpoint folder's weights between float and FP8 block-quantized form.

`quantize_folder` turns every projection weight (attention and MLP/expert `*_proj.weight`, DeepSeek-V3.2's
indexer `wq_b`/`wk`; 2-D)
into float8_e4m3fn plus a float32 `weight_scale_inv` per 128×128 block, and writes the
`quantization_config` the published checkpoints carry (DeepSeek-V3's, also written for GLM-4.x, or Qwen3-FP8's
with its `modules_to_not_convert`). Embeddings, norms, the router and the LM head keep their dtype.
`dequantize_folder` writes the float copy a reference (transformers on CPU) can run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from afd.kernels.fp8_blocks import BLOCK, FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8

SCALE_SUFFIX = "_scale_inv"


INDEXER_FP8 = ("indexer.wq_b.weight", "indexer.wk.weight")  # DeepSeek-V3.2's indexer projections stored FP8
INDEXER_KEPT = "indexer.weights_proj.weight"  # its head weights: kept in their dtype (transformers keeps them float32)


def is_projection_weight(key: str) -> bool:
    """By name, the weights the published FP8 checkpoints store in FP8: projections (`*_proj.weight`) and
    DeepSeek-V3.2's indexer `wq_b`/`wk`, not the indexer's `weights_proj`, the router (`mlp.gate.weight`),
    embeddings, norms or the LM head."""
    return (key.endswith("_proj.weight") and not key.endswith(INDEXER_KEPT)) or key.endswith(INDEXER_FP8)


def is_quantized_weight(key: str, tensor: torch.Tensor) -> bool:
    """The tensors our quantizer writes in FP8: 2-D projection weights."""
    return tensor.dim() == 2 and is_projection_weight(key)


def quantization_config(model_type: str, gate_modules: list[str]) -> dict:
    """The quantization_config of the published FP8 checkpoints of `model_type`."""
    config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    if model_type == "qwen3_moe":  # Qwen3-*-FP8 name the modules they keep in their original dtype
        config["modules_to_not_convert"] = ["lm_head", *gate_modules]
    return config


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weight files")
    return files


def quantize_folder(folder: str | Path) -> None:
    """FP8-quantize the checkpoint in `folder` in place (weights and config.json)."""
    folder = Path(folder)
    gates: list[str] = []
    for file in _weight_files(folder):
        tensors = load_file(str(file))
        out: dict[str, torch.Tensor] = {}
        for key, tensor in tensors.items():
            if key.endswith(".mlp.gate.weight"):
                gates.append(key.removesuffix(".weight"))
            if is_quantized_weight(key, tensor):
                out[key], out[key + SCALE_SUFFIX] = quantize_block_fp8(tensor)
            else:
                out[key] = tensor
        save_file(out, str(file), metadata={"format": "pt"})
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = quantization_config(config.get("model_type", ""), sorted(gates))
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def dequantize_folder(source: str | Path, target: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Copy the FP8 checkpoint `source` to `target` with every FP8 weight dequantized to `dtype` and no
    quantization_config (what transformers loads as a plain checkpoint)."""
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json" and item.is_file():
            shutil.copy(item, target / item.name)
    for file in _weight_files(source):
        tensors = load_file(str(file))
        out = {}
        for key, tensor in tensors.items():
            if key.endswith(SCALE_SUFFIX):
                continue
            if tensor.dtype == FP8_DTYPE:
                tensor = dequantize_block_fp8(tensor, tensors[key + SCALE_SUFFIX], dtype)
            out[key] = tensor
        save_file(out, str(target / file.name), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return target
