"""Qwen3-MoE for vLLM's attention role: vLLM's `Qwen3MoeModel` with remote FFNs (see `remote`)."""

from __future__ import annotations

from functools import partial

from vllm.config import VllmConfig
from vllm.model_executor.models import qwen3_moe as vllm_qwen3_moe
from vllm.model_executor.models.utils import extract_layer_index

from afd.vllm_plugin.link import StepLink
from afd.vllm_plugin.remote import AFDCausalLM, NoModule, make_remote, swapped


class AFDQwen3MoeDecoderLayer(vllm_qwen3_moe.Qwen3MoeDecoderLayer):
    """vLLM's decoder layer (its forward unchanged); on crossing layers the FFN is remote."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", *, link: StepLink, link_id: int, **kwargs):
        index = extract_layer_index(prefix)
        if index not in link.plan.crossing:
            super().__init__(vllm_config, prefix, **kwargs)
            return
        with swapped(vllm_qwen3_moe, Qwen3MoeSparseMoeBlock=NoModule, Qwen3MoeMLP=NoModule):
            super().__init__(vllm_config, prefix, **kwargs)
        make_remote(self, index, link, link_id, vllm_config.model_config.hf_text_config, prefix)


class AFDQwen3MoeForCausalLM(AFDCausalLM):
    """`architectures: [AFDQwen3MoeForCausalLM]` in hf_overrides selects this attention-role model."""

    def build_model(self, vllm_config, prefix, link, link_id):
        layer_type = partial(AFDQwen3MoeDecoderLayer, link=link, link_id=link_id)
        return vllm_qwen3_moe.Qwen3MoeModel(vllm_config=vllm_config, prefix=prefix, decoder_layer_type=layer_type)
