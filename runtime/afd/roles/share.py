"""What the roles share: a role's share of the weights (`load_share`), whether its CUDA graphs can run
(`graphs_usable`), and the registry its series go to (`watched_registry`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry

from afd.config import AFDConfig
from afd.connector import registry
from afd.kernels.compile_watch import WATCH
from afd.metrics.wiring import export_kernel_compiles
from afd.models.loader import LoadedModel, load_model
from afd.models.moe_prep import warm_up
from afd.runners.device import resolve_dtype, torch_dtype
from afd.runners.handshake import make_hello

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Share:
    """One role's loaded share of the model, on its device, in its dtype."""

    loaded: LoadedModel
    device: torch.device
    dtype: str  # a name of afd.connector.tensors.DTYPES

    def hello(self, config: AFDConfig):
        return make_hello(config, self.loaded.spec, self.loaded.crossing, self.loaded.fingerprint, self.dtype)


def load_share(config: AFDConfig, device: torch.device) -> Share:
    """The weights of `config.role` on `device` (the FFN's MoE kernels warmed up on a GPU)."""
    dtype = resolve_dtype(config, device)
    shard = (config.ffn_shard, config.ffn_expert_parallel) if config.role == "ffn" else (0, 1)
    loaded = load_model(config.model, config.role, config.gate_on_attention, torch_dtype(dtype), device, shard)
    if config.role == "ffn" and device.type == "cuda":
        log.info("ffn rank %d: MoE kernels warmed up for %d token counts", config.rank, warm_up(loaded.model))
    return Share(loaded, device, dtype)


def graphs_usable(config: AFDConfig, device: torch.device, dtype: str) -> bool:
    """CUDA graphs need a GPU, a data plane whose transfers can be captured (not host frames) and bf16/fp16."""
    if not config.cuda_graphs:
        return False
    problems = [
        why for bad, why in (
            (device.type != "cuda", "no CUDA device"),
            (not registry.transport(config.connector).graph_capturable,
             f"connector={config.connector} moves tensors through the host"),
            (dtype == "float32", "float32 experts take the host-synchronising reference path"),
        ) if bad
    ]
    if problems:
        log.warning("cuda_graphs is on but disabled here: %s", "; ".join(problems))
    return not problems


def watched_registry(config: AFDConfig) -> CollectorRegistry:
    """A serving rank's registry, made before its role is built: Triton kernels compiled after warm-up are logged
    and counted there."""
    series = CollectorRegistry()
    if WATCH.install():
        export_kernel_compiles(series, config, WATCH)
    return series
