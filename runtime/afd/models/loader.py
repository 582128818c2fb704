"""Load one role's share of a model from a checkpoint folder, reading only its tensors."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch

from afd.config.process import process_setting
from afd.models import deepseek_v2, deepseek_v3, deepseek_v32, glm4_moe, qwen3_moe
from afd.models.decoder import MoECausalLM
from afd.models.checkpoint import Checkpoint
from afd.models.expert_shard import shard_ffn_model, shard_parts
from afd.kernels.fp8_blocks import FP8_DTYPE, dequantize_block_fp8
from afd.models.fp8 import Fp8Linear
from afd.models.layers import MoE, Router
from afd.models.moe_prep import fuse_shared_experts
from afd.models.quantization import SCALE_SUFFIX, check_fp8_tensors, convert_to_fp8, parse_quantization, resident_bytes
from afd.models.spec import ModelSpec, UnsupportedModelError, parse_spec
from afd.models.split import prune_for_role
from afd.config.topology import crossing_layers

log = logging.getLogger(__name__)
FAMILIES = {"deepseek_v2": deepseek_v2.build, "qwen3_moe": qwen3_moe.build, "glm4_moe": glm4_moe.build,
            "deepseek_v32": deepseek_v32.build, **{arch: deepseek_v3.build for arch in deepseek_v3.ARCHES}}
_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<name>gate_up|down)(?P<scale>_scale)?$")


@dataclass
class LoadedModel:
    """A role's model plus what the handshake and the tests need to know about it."""

    model: MoECausalLM
    spec: ModelSpec
    crossing: tuple[int, ...]
    fingerprint: str
    loaded_keys: list[str] = field(default_factory=list)
    resident_bytes: int = 0  # every weight, scale, norm and bias this role holds


def load_model(
    path: str,
    role: str = "monolithic",
    gate_on_attention: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    shard: tuple[int, int] = (0, 1),
    keep_fp8: bool | None = None,
) -> LoadedModel:
    """Build `role`'s part of the model on `device` from the checkpoint at `path`; an FFN rank of
    G shards loads shard `shard = (s, G)` of it (`afd.models.expert_shard`). An FP8 checkpoint
    (`afd.models.quantization`) stays FP8 when `keep_fp8` (default: on CUDA), else is dequantized to `dtype`."""
    checkpoint = Checkpoint(path)
    fmt = parse_quantization(checkpoint.config)
    check_fp8_tensors(fmt, checkpoint.keys(), checkpoint.dtypes())
    keep = fmt is not None and (torch.device(device).type == "cuda" if keep_fp8 is None else keep_fp8)
    fp8_weights = (lambda key: key + SCALE_SUFFIX in checkpoint) if keep else None
    model, spec, crossing = build_share(checkpoint.config, role, gate_on_attention, dtype, device, shard, fp8_weights)
    _log_unread_mtp_layers(checkpoint, spec.num_layers)
    _load_weights(model, checkpoint)
    finish_share(model, dtype, device)
    held = resident_bytes(model)
    log.info("%s%s holds %.3f GiB of weights (%d bytes%s)", role,
             f" shard {shard[0]}/{shard[1]}" if shard[1] > 1 else "", held / 2**30, held, ", FP8 with block scales" if keep else ", FP8 dequantized at load" if fmt else "")
    return LoadedModel(model, spec, crossing, checkpoint.fingerprint(), list(checkpoint.loaded_keys), held)


def build_share(config: dict, role: str, gate_on_attention: bool, dtype: torch.dtype, device: str | torch.device,
                shard: tuple[int, int] = (0, 1), fp8_weights=None):
    """(model, spec, crossing layers): `role`'s part of the model from its `config.json`, weights not yet set.
    `fp8_weights(weight name) -> bool`, if given, says which weights stay FP8 (`quantization.convert_to_fp8`)."""
    spec = parse_spec(config)
    with torch.device("meta"):
        model = FAMILIES[spec.arch](config, spec)
    crossing = crossing_layers(spec.moe_layers, gate_on_attention)
    prune_for_role(model, role, crossing, gate_on_attention)
    if shard[1] > 1:
        if role != "ffn":
            raise ValueError(f"only the ffn role is expert-parallel, not {role!r}")
        shard_ffn_model(model, *shard)
    # dtypes first, on meta, then one allocation per tensor in its final dtype: allocating float32 and converting
    # would briefly need twice the weights and leave the caching allocator's segments split (issue 33: ~40 GB the
    # KV cache could not take at DeepSeek-V2-Lite shapes)
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, Router) and module.fp32_logits:
            module.float()  # DeepSeek keeps its gate in float32
        if isinstance(module, MoE) and module.e_score_correction_bias is not None:
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()  # as transformers
        if getattr(module, "keep_float32", False):  # DeepSeek-V3.2's indexer head weights, as transformers keeps them
            module.float()
    if fp8_weights is not None:
        convert_to_fp8(model, fp8_weights)
    model.to_empty(device=device)
    return model, spec, crossing


def finish_share(model: MoECausalLM, dtype: torch.dtype, device: str | torch.device) -> None:
    """Once the weights are set: inference mode; on a GPU the batch-invariant GEMMs if AFD_BATCH_INVARIANT asks,
    and in bf16/fp16 one kernel pair per MoE layer (and in bf16 float32 routers on tensor cores)."""
    model.eval().requires_grad_(False)
    if torch.device(device).type == "cuda" and process_setting("AFD_BATCH_INVARIANT"):
        from afd.kernels import batch_invariant  # local import: Triton, only where its kernel runs

        if batch_invariant.install():
            log.info("batch-invariant mode: aten's dense products run one fixed-tiling Triton kernel "
                     "(AFD_BATCH_INVARIANT)")
    if torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        for module in model.modules():
            if isinstance(module, MoE):
                fuse_shared_experts(module)
            if isinstance(module, Router) and dtype == torch.bfloat16:
                module.split_weight()
            if hasattr(module, "fuse_projections"):  # attention's input projections in one GEMM (issue 33)
                module.fuse_projections()


def _log_unread_mtp_layers(checkpoint: Checkpoint, num_layers: int) -> None:
    """One line naming the next-token-prediction layers (`model.layers.{N..}`, N = num_hidden_layers) that a
    DeepSeek-V3 or GLM-4.x checkpoint carries for speculative decoding: this runtime neither reads nor keeps them."""
    layers: dict[int, int] = {}
    for key in checkpoint.keys():
        match = re.match(r"model\.layers\.(\d+)\.", key)
        if match and int(match[1]) >= num_layers:
            layers[int(match[1])] = layers.get(int(match[1]), 0) + 1
    if layers:
        names = ", ".join(f"model.layers.{index}" for index in sorted(layers))
        plural = "s" if len(layers) > 1 else ""
        log.info("checkpoint holds %d next-token-prediction (MTP) layer%s (%s, %d tensors): not read, not resident",
                 len(layers), plural, names, sum(layers.values()))


def _load_weights(model: MoECausalLM, checkpoint: Checkpoint) -> None:
    parts = shard_parts(model)
    by_layer: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, param in [*model.named_parameters(), *_fp8_buffers(model)]:
        group = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
        by_layer.setdefault(group, []).append((name, param))
    for params in by_layer.values():  # one layer at a time bounds peak host memory
        plans = [(param, _sources(name, param, checkpoint, parts)) for name, param in params]
        tensors = checkpoint.read(key for _, (keys, _) in plans for key in keys)
        for param, (keys, assemble) in plans:
            value = assemble([tensors[key] for key in keys])
            if value.shape != param.shape:
                raise ValueError(f"{keys[0]}: checkpoint shape {tuple(value.shape)} != model shape {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(value)


def _fp8_buffers(model: MoECausalLM):
    """(name, buffer) of the FP8 storage `convert_to_fp8` gave the model: Fp8Linear weights and scales, expert
    stacks' scales (loaded like parameters)."""
    for name, buffer in model.named_buffers():
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(owner, Fp8Linear) or name.endswith("_scale"):
            yield name, buffer


def _sources(name: str, param: torch.Tensor, checkpoint: Checkpoint, parts: dict):
    """Checkpoint keys holding `name` and how to assemble them into the parameter (an
    expert-parallel shard's slices are read as slices: `afd.models.expert_shard.shard_parts`).
    FP8 weights become `param`'s dtype: kept with their scales (read as their own tensors) or dequantized."""
    keep = param.dtype == FP8_DTYPE or name.endswith(SCALE_SUFFIX) or name.endswith("_scale")
    match = _EXPERTS.match(name)
    if match:
        prefix, kind = match["prefix"], match["name"]
        _, first, stop = parts.get(f"{prefix}.{kind}", (0, 0, param.shape[0]))
        count = stop - first
        fused = f"{prefix}.{kind}_proj"
        if fused in checkpoint:  # already stacked on disk (newer transformers layout)
            if fused + SCALE_SUFFIX in checkpoint:
                raise UnsupportedModelError(f"{fused}: FP8 experts stacked in one tensor are not supported (the "
                                            "published FP8 checkpoints store one tensor per expert)")
            return [], lambda tensors: checkpoint.read_part(fused, 0, first, first + count)
        suffix = "weight" + (SCALE_SUFFIX if match["scale"] else "")
        experts = range(first, first + count)
        if kind == "down":
            keys, assemble = [f"{prefix}.{e}.down_proj.{suffix}" for e in experts], torch.stack
        else:
            keys = [f"{prefix}.{e}.{proj}.{suffix}" for e in experts for proj in ("gate_proj", "up_proj")]
            assemble = lambda tensors: torch.stack([torch.cat(tensors[i : i + 2]) for i in range(0, len(tensors), 2)])
        return (keys, assemble) if keep else _dequantizing(keys, assemble, checkpoint, param.dtype)
    if name.endswith(".mlp.e_score_correction_bias"):  # the checkpoint keeps it in the gate
        return [name.replace(".mlp.", ".mlp.gate.")], lambda tensors: tensors[0]
    weight_of_scale = name.removesuffix(SCALE_SUFFIX)
    if name.endswith(SCALE_SUFFIX) and parts.get(weight_of_scale):  # a kept FP8 slice's scale: its blocks
        dim, start, stop = parts[weight_of_scale]
        block = checkpoint_block(checkpoint)
        return [], lambda tensors: checkpoint.read_part(name, dim, start // block, -(-stop // block))
    if name in parts:
        part = parts[name]
        if part is None:
            return [], lambda tensors: torch.zeros(param.shape)
        if keep or name + SCALE_SUFFIX not in checkpoint:
            return [], lambda tensors: checkpoint.read_part(name, *part)
        return [], lambda tensors: _read_part_dequantized(checkpoint, name, *part, param.dtype)
    if name == "lm_head.weight" and name not in checkpoint and model_ties_embeddings(checkpoint):
        return ["model.embed_tokens.weight"], lambda tensors: tensors[0]
    keys, assemble = [name], lambda tensors: tensors[0]
    return (keys, assemble) if keep else _dequantizing(keys, assemble, checkpoint, param.dtype)


def _dequantizing(keys: list[str], assemble, checkpoint: Checkpoint, dtype: torch.dtype):
    """(keys, assemble) that also reads the scale of each FP8 key and hands `assemble` dequantized tensors."""
    scaled = [key for key in keys if key + SCALE_SUFFIX in checkpoint]
    if not scaled:
        return keys, assemble
    block = checkpoint_block(checkpoint)
    everything = keys + [key + SCALE_SUFFIX for key in scaled]

    def dequantized(tensors: list[torch.Tensor]) -> torch.Tensor:
        by_key = dict(zip(everything, tensors))
        return assemble([dequantize_block_fp8(by_key[k], by_key[k + SCALE_SUFFIX], dtype, block)
                         if k + SCALE_SUFFIX in by_key else by_key[k] for k in keys])

    return everything, dequantized


def _read_part_dequantized(checkpoint: Checkpoint, key: str, dim: int, start: int, stop: int,
                           dtype: torch.dtype) -> torch.Tensor:
    """Rows/columns [start, stop) of FP8 weight `key`, dequantized: the blocks covering them are read, no more."""
    block = checkpoint_block(checkpoint)
    first, last = start // block, -(-stop // block)
    scale = checkpoint.read_part(key + SCALE_SUFFIX, dim, first, last)
    blocks = checkpoint.read_part(key, dim, first * block, last * block)
    if dim == 0:
        return dequantize_block_fp8(blocks, scale, dtype, block)[start - first * block : stop - first * block]
    return dequantize_block_fp8(blocks, scale, dtype, block)[:, start - first * block : stop - first * block]


def checkpoint_block(checkpoint: Checkpoint) -> int:
    fmt = parse_quantization(checkpoint.config)
    return fmt.block if fmt else 128


def model_ties_embeddings(checkpoint: Checkpoint) -> bool:
    return bool(checkpoint.config.get("tie_word_embeddings", False))
