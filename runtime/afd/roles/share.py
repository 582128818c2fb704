"""What the roles share: a role's share of the weights (`load_share`) and whether its CUDA graphs can run
(`graphs_usable`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from afd.config import GraphSettings, GroupSettings, LinkSettings, SplitSettings
from afd.connector import registry
from afd.models.loader import LoadedModel, load_model
from afd.models.moe_prep import warm_up
from afd.runners.device import torch_dtype
from afd.runners.handshake import make_hello

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Share:
    """One role's loaded share of the model, on its device, in its dtype."""

    loaded: LoadedModel
    device: torch.device
    dtype: str  # a name of afd.connector.tensors.DTYPES

    def hello(self, group: GroupSettings, split: SplitSettings, link: LinkSettings):
        return make_hello(group, split, link, self.loaded.spec, self.loaded.crossing, self.loaded.fingerprint,
                          self.dtype)


def load_share(group: GroupSettings, split: SplitSettings, model: str, device: torch.device, dtype: str) -> Share:
    """The weights of `group.role` of the checkpoint at `model` on `device` in `dtype` (both resolved by the role
    builder: `afd.runners.device`), the FFN's MoE kernels warmed up on a GPU."""
    shard = (group.ffn_shard, group.ffn_expert_parallel) if group.role == "ffn" else (0, 1)
    loaded = load_model(model, group.role, split.gate_on_attention, torch_dtype(dtype), device, shard)
    if group.role == "ffn" and device.type == "cuda":
        log.info("ffn rank %d: MoE kernels warmed up for %d token counts", group.rank, warm_up(loaded.model))
    return Share(loaded, device, dtype)


def graphs_usable(graphs: GraphSettings, link: LinkSettings, device: torch.device, dtype: str) -> bool:
    """CUDA graphs need a GPU, a data plane whose transfers can be captured (not host frames) and bf16/fp16."""
    if not graphs.cuda_graphs:
        return False
    problems = [
        why for bad, why in (
            (device.type != "cuda", "no CUDA device"),
            (not registry.transport(link.connector).graph_capturable,
             f"connector={link.connector} moves tensors through the host"),
            (dtype == "float32", "float32 experts take the host-synchronising reference path"),
        ) if bad
    ]
    if problems:
        log.warning("cuda_graphs is on but disabled here: %s", "; ".join(problems))
    return not problems

