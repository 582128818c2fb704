"""DeepSeek-V2 for vLLM's attention role: vLLM's `DeepseekV2Model` (MLA) with remote FFNs (see `remote`).

vLLM's DeepSeek model builds its decoder layers by name, so the layer class is swapped
for ours while the model is constructed; the router keeps DeepSeek's float32 gate.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models import deepseek_v2 as vllm_deepseek_v2

from afd.vllm_plugin.link import StepLink
from afd.vllm_plugin.remote import AFDCausalLM, NoModule, make_remote, swapped

_BUILDING: dict[str, tuple[StepLink, int]] = {}  # the link of the model under construction


class AFDDeepseekV2DecoderLayer(vllm_deepseek_v2.DeepseekV2DecoderLayer):
    """vLLM's decoder layer (its forward unchanged); on crossing layers the FFN is remote."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, **kwargs):
        link, link_id = _BUILDING["link"]
        index = int(prefix.split(".")[-1])
        if index not in link.plan.crossing:
            super().__init__(vllm_config, prefix, **kwargs)
            return
        with swapped(vllm_deepseek_v2, DeepseekV2MoE=NoModule, DeepseekV2MLP=NoModule):
            super().__init__(vllm_config, prefix, **kwargs)
        make_remote(self, index, link, link_id, vllm_config.model_config.hf_config, prefix, gate_dtype=torch.float32)


class AFDDeepseekV2ForCausalLM(AFDCausalLM):
    """`architectures: [AFDDeepseekV2ForCausalLM]` in hf_overrides selects this attention-role model."""

    def build_model(self, vllm_config, prefix, link, link_id):
        _BUILDING["link"] = (link, link_id)
        try:
            with swapped(vllm_deepseek_v2, DeepseekV2DecoderLayer=AFDDeepseekV2DecoderLayer):
                return vllm_deepseek_v2.DeepseekV2Model(vllm_config=vllm_config, prefix=prefix)
        finally:
            _BUILDING.clear()
