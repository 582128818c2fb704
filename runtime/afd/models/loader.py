"""Load one role's share of a model from a checkpoint folder, reading only its tensors."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from afd.models import deepseek_v2, qwen3_moe
from afd.models.base import MoECausalLM
from afd.models.checkpoint import Checkpoint
from afd.models.layers import MoE, Router
from afd.models.spec import ModelSpec, parse_spec
from afd.models.split import prune_for_role
from afd.topology import crossing_layers

FAMILIES = {"deepseek_v2": deepseek_v2.build, "qwen3_moe": qwen3_moe.build}
_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<name>gate_up|down)$")


@dataclass
class LoadedModel:
    """A role's model plus what the handshake and the tests need to know about it."""

    model: MoECausalLM
    spec: ModelSpec
    crossing: tuple[int, ...]
    fingerprint: str
    loaded_keys: list[str] = field(default_factory=list)


def load_model(
    path: str,
    role: str = "monolithic",
    gate_on_attention: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Build `role`'s part of the model on `device` from the checkpoint at `path`."""
    checkpoint = Checkpoint(path)
    model, spec, crossing = build_share(checkpoint.config, role, gate_on_attention, dtype, device)
    _load_weights(model, checkpoint)
    finish_share(model, dtype, device)
    return LoadedModel(model, spec, crossing, checkpoint.fingerprint(), list(checkpoint.loaded_keys))


def build_share(config: dict, role: str, gate_on_attention: bool, dtype: torch.dtype, device: str | torch.device):
    """(model, spec, crossing layers): `role`'s part of the model from its `config.json`, weights not yet set."""
    spec = parse_spec(config)
    with torch.device("meta"):
        model = FAMILIES[spec.arch](config, spec)
    crossing = crossing_layers(spec.moe_layers, gate_on_attention)
    prune_for_role(model, role, crossing, gate_on_attention)
    model.to_empty(device=device)
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, Router) and module.fp32_logits:
            module.float()  # DeepSeek keeps its gate in float32
    return model, spec, crossing


def finish_share(model: MoECausalLM, dtype: torch.dtype, device: str | torch.device) -> None:
    """Once the weights are set: inference mode, and on a GPU in bf16/fp16 one kernel pair per MoE layer."""
    model.eval().requires_grad_(False)
    if torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        from afd.models.moe_prep import fuse_shared_experts

        for module in model.modules():
            if isinstance(module, MoE):
                fuse_shared_experts(module)


def _load_weights(model: MoECausalLM, checkpoint: Checkpoint) -> None:
    by_layer: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        group = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
        by_layer.setdefault(group, []).append((name, param))
    for params in by_layer.values():  # one layer at a time bounds peak host memory
        plans = [(param, _sources(name, param, checkpoint)) for name, param in params]
        tensors = checkpoint.read(key for _, (keys, _) in plans for key in keys)
        for param, (keys, assemble) in plans:
            value = assemble([tensors[key] for key in keys])
            if value.shape != param.shape:
                raise ValueError(f"{keys[0]}: checkpoint shape {tuple(value.shape)} != model shape {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(value)


def _sources(name: str, param: torch.nn.Parameter, checkpoint: Checkpoint):
    """Checkpoint keys holding `name` and how to assemble them into the parameter."""
    match = _EXPERTS.match(name)
    if match:
        prefix, kind = match["prefix"], match["name"]
        fused = f"{prefix}.{kind}_proj"
        if fused in checkpoint:  # already stacked on disk (newer transformers layout)
            return [fused], lambda tensors: tensors[0]
        count = param.shape[0]
        if kind == "down":
            return [f"{prefix}.{e}.down_proj.weight" for e in range(count)], torch.stack
        keys = [f"{prefix}.{e}.{proj}.weight" for e in range(count) for proj in ("gate_proj", "up_proj")]
        return keys, lambda tensors: torch.stack([torch.cat(tensors[i : i + 2]) for i in range(0, len(tensors), 2)])
    if name == "lm_head.weight" and name not in checkpoint and model_ties_embeddings(checkpoint):
        return ["model.embed_tokens.weight"], lambda tensors: tensors[0]
    return [name], lambda tensors: tensors[0]


def model_ties_embeddings(checkpoint: Checkpoint) -> bool:
    return bool(checkpoint.config.get("tie_word_embeddings", False))
