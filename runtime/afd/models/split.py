"""The attention/FFN split as a transform over one model definition.

`prune_for_role` removes, before any weight is read, every module the role does not
run. What is left is exactly the set of tensors that role loads from disk.
"""

from __future__ import annotations

from typing import Sequence

from afd.models.decoder import MoECausalLM

ROLES = ("monolithic", "attention", "ffn")


def prune_for_role(model: MoECausalLM, role: str, crossing: Sequence[int], gate_on_attention: bool) -> None:
    """Drop the modules `role` never runs; `crossing` lists the layers whose FFN is remote."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: must be one of {', '.join(ROLES)}")
    if role == "attention":
        for index in crossing:
            _prune_attention_layer(model.layers[index], gate_on_attention)
    elif role == "ffn":
        model.model.embed_tokens = None
        model.model.norm = None
        model.lm_head = None
        remote = set(crossing)
        for index, layer in enumerate(model.layers):
            _prune_ffn_layer(layer, index in remote, gate_on_attention)


def _prune_attention_layer(layer, gate_on_attention: bool) -> None:
    if gate_on_attention:  # keep the norm and the gate; the experts (and what chooses among them) are remote
        layer.mlp.experts = None
        layer.mlp.shared_experts = None
        layer.mlp.e_score_correction_bias = None
    else:
        layer.post_attention_layernorm = None
        layer.mlp = None


def _prune_ffn_layer(layer, is_remote: bool, gate_on_attention: bool) -> None:
    layer.input_layernorm = None
    layer.self_attn = None
    if not is_remote:
        layer.post_attention_layernorm = None
        layer.mlp = None
    elif gate_on_attention:  # attention ships normed hidden states and router logits
        layer.post_attention_layernorm = None
        layer.mlp.gate = None
