"""What every AFD attention-role model for vLLM shares: the remote FFN, the split, the weights.

A family module (`qwen3_moe`, `deepseek_v2`) builds vLLM's own decoder stack with one change
per crossing layer: while the layer is constructed, vLLM's MLP and MoE classes are swapped
for `NoModule` (so no expert is built and no expert weight allocated), then the layer's MLP
becomes a `RemoteFFN`. With the gate on the FFN the post-attention norm runs there too, so
here it becomes a plain residual add: vLLM's layer then hands the un-normed residual stream
to `RemoteFFN`, and the next layer's fused add-norm adds the FFN output back. With the gate
on attention the norm and the router stay here and the FFN gets normed rows plus logits.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from types import ModuleType
from typing import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix

from afd.models.checkpoint import Checkpoint
from afd.vllm_plugin.link import StepLink
from afd.vllm_plugin.ops import ffn_exchange, register_link
from afd.vllm_plugin.weights import attention_keys

log = logging.getLogger(__name__)
LAST_LOAD: dict[str, list[str]] = {}  # what the latest load read and built (tests inspect it in-process)


class RemoteFFN(nn.Module):
    """A crossing layer's FFN on the FFN rank; with the gate on attention it keeps the router."""

    def __init__(self, layer: int, link_id: int, hidden_size: int, num_experts: int, gate_on_attention: bool,
                 prefix: str, gate_dtype: torch.dtype | None = None):
        super().__init__()
        self.layer = layer
        self.link_id = link_id
        self.gate = (
            ReplicatedLinear(hidden_size, num_experts, bias=False, return_bias=False, params_dtype=gate_dtype,
                             prefix=f"{prefix}.gate")
            if gate_on_attention else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = None
        if self.gate is not None:  # [tokens, experts], computed in the gate's dtype, shipped as float32
            logits = self.gate(hidden.to(self.gate.weight.dtype)).float()
        return ffn_exchange(hidden, logits, self.layer, self.link_id)


class ResidualAdd(nn.Module):
    """Stands in for the fused add-RMSNorm when the norm runs on the FFN rank."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = hidden + residual
        return total, total


class NoModule(nn.Module):
    """Built instead of vLLM's MLP/MoE block while a crossing layer is constructed; holds nothing."""

    def __init__(self, *args, **kwargs):
        super().__init__()


@contextmanager
def swapped(module: ModuleType, **replacements):
    """Temporarily rebind names in one of vLLM's model modules (construction time only)."""
    saved = {name: getattr(module, name) for name in replacements}
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def make_remote(layer_module: nn.Module, index: int, link: StepLink, link_id: int, config, prefix: str,
                gate_dtype: torch.dtype | None = None) -> None:
    """Turn crossing layer `index` (built without its FFN) into its attention-side half."""
    gate = link.plan.gate_on_attention
    layer_module.mlp = RemoteFFN(index, link_id, config.hidden_size, link.plan.spec.num_experts, gate, f"{prefix}.mlp", gate_dtype)
    if not gate:
        layer_module.post_attention_layernorm = ResidualAdd()


class AFDCausalLM(nn.Module):
    """vLLM attention-role model: the family's decoder stack (`build_model`) + LM head + our FFN link."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        config = model_config.hf_text_config
        self.config = config
        self.model_path = model_config.model
        self.link = StepLink.from_env(self.model_path, model_config.dtype)
        self.model = self.build_model(vllm_config, maybe_prefix(prefix, "model"), self.link, register_link(self.link))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config, prefix=maybe_prefix(prefix, "lm_head")
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def build_model(self, vllm_config: VllmConfig, prefix: str, link: StepLink, link_id: int) -> nn.Module:
        raise NotImplementedError

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Read only the attention side's tensors; vLLM's own iterator is lazy and stays unread."""
        return load_attention_weights(self, self.model_path, self.link)


def load_attention_weights(model: nn.Module, path: str, link: StepLink) -> set[str]:
    """Feed `model` the checkpoint tensors the attention side owns, one layer at a time."""
    checkpoint = Checkpoint(path)
    keys = attention_keys(checkpoint.keys(), link.plan.crossing, link.plan.gate_on_attention)
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(".".join(key.split(".")[:3]), []).append(key)

    def tensors():
        for group in groups.values():
            yield from checkpoint.read(group).items()

    loaded = AutoWeightsLoader(model).load_weights(tensors())
    LAST_LOAD.update(read_keys=list(checkpoint.loaded_keys), params=[name for name, _ in model.named_parameters()])
    log.info("afd: attention side read %d of %d checkpoint tensors", len(checkpoint.loaded_keys), len(checkpoint.keys()))
    return loaded
