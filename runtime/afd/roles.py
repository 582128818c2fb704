"""A role from its config in two parts: `load_share` reads the weights, `assemble_*` wires the rest.

`build_ffn` gives a ready FFN worker; `build_attention` a connected, handshaken attention
rank with its KV cache. Both read the whole configuration from `AFDConfig`; the benchmarks
assemble roles around a share they loaded once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from afd.config import AFDConfig
from afd.connector import registry
from afd.connector.attention_link import AttentionLink
from afd.connector.expert_link import ShardedLink
from afd.connector.ffn_link import FFNLink
from afd.connector.identity import identity_key
from afd.connector.plane import DataContract, PlaneOptions
from afd.graphs.ffn_graphs import FFNGraphs
from afd.kv_cache import KVCache
from afd.metrics.layer_clock import StepInstruments
from afd.models.loader import LoadedModel, load_model
from afd.models.moe_prep import warm_up
from afd.runners.attention_runner import AttentionRunner, StepOptions
from afd.runners.device import resolve_device, resolve_dtype, torch_dtype
from afd.runners.ffn_executor import FFNStepExecutor
from afd.runners.ffn_worker import FFNWorker
from afd.runners.handshake import make_hello
from afd.runners.step_order import step_order
from afd.runners.warm_steps import warm_rank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Share:
    """One role's loaded share of the model, on its device, in its dtype."""

    loaded: LoadedModel
    device: torch.device
    dtype: str  # a name of afd.connector.tensors.DTYPES

    def hello(self, config: AFDConfig):
        return make_hello(config, self.loaded.spec, self.loaded.crossing, self.loaded.fingerprint, self.dtype)


def load_share(config: AFDConfig) -> Share:
    """The weights of `config.role` on its device (the FFN's MoE kernels warmed up on a GPU)."""
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    shard = (config.ffn_shard, config.ffn_expert_parallel) if config.role == "ffn" else (0, 1)
    loaded = load_model(config.model, config.role, config.gate_on_attention, torch_dtype(dtype), device, shard)
    if config.role == "ffn" and device.type == "cuda":
        log.info("ffn rank %d: MoE kernels warmed up for %d token counts", config.rank, warm_up(loaded.model))
    return Share(loaded, device, dtype)


def assemble_ffn(config: AFDConfig, share: Share, instruments: StepInstruments = StepInstruments()) -> FFNWorker:
    """FFN rank `config.rank` around its loaded share: listening for its attention peers."""
    expected = share.hello(config)
    transport = registry.transport(config.connector)
    server = transport.open_server(config)
    contract = DataContract(share.loaded.spec.hidden_size, share.dtype, expected.router_width)
    plane = transport.ffn_plane(PlaneOptions(share.device, config.peer_timeout_s), contract, server)
    served = config.topology.attention_ranks_of(config.rank)
    log.info("ffn rank %d%s serves attention ranks %s on layers %s", config.rank,
             f" shard {config.ffn_shard} of {config.ffn_expert_parallel}" if config.ffn_expert_parallel > 1 else "",
             list(served), list(share.loaded.crossing))
    link = FFNLink(server, plane, expected, served, config.rank, identity_key(config.group_token, config.group_secret))
    graphs = None
    if graphs_usable(config, share.device, share.dtype):
        graphs = FFNGraphs(share.device)
    return FFNWorker(link, FFNStepExecutor(share.loaded, plane, expected, graphs, instruments), order=step_order(config))


def build_ffn(config: AFDConfig, instruments: StepInstruments = StepInstruments()) -> FFNWorker:
    return assemble_ffn(config, load_share(config), instruments)


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


@dataclass(frozen=True)
class AttentionRole:
    """A connected attention rank: model share, KV cache, runner and its link."""

    loaded: LoadedModel
    kv_cache: KVCache
    link: AttentionLink  # or afd.connector.expert_link.ShardedLink, which has its interface
    runner: AttentionRunner
    device: torch.device

    def close(self, reason: str = "shutdown") -> None:
        if self.runner.graphs is not None:  # release graphs first, then the link (docs/architecture.md)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.runner.graphs = self.runner.mixed_graphs = None
        self.link.close(reason)


def assemble_attention(config: AFDConfig, share: Share, kv_cache: KVCache,
                       instruments: StepInstruments = StepInstruments()) -> AttentionRole:
    """Attention rank `config.rank` around its share and KV cache: handshaken, decode graphs captured."""
    if config.ffn_expert_parallel > 1:  # one link per shard, summed (afd.connector.expert_link)
        link = ShardedLink.connect(config, share.hello(config), share.device)
    else:
        link = AttentionLink.connect(config, share.hello(config), share.device)
    runner = AttentionRunner(share.loaded, link, kv_cache, StepOptions.of(config), instruments)
    link.listen(runner)
    if graphs_usable(config, share.device, share.dtype):
        try:  # warm-up and capture drive the FFN through their plans; Ready only after this
            graphs = runner.capture_graphs(min(config.max_num_seqs, kv_cache.num_blocks),
                                           mixed_tokens=config.piecewise_graph_tokens)
        except Exception:
            link.close("graph capture failed")
            raise
        log.info("attention rank %d: decode graphs for %s sequences, %.1f MiB",
                 config.rank, list(graphs.buckets), graphs.memory_bytes / 2**20)
    if share.device.type == "cuda":  # Triton compiles what prompt steps meet now, not while serving
        runner.warming = True  # the FFN counts its own compiles in these steps as warm-up
        try:
            warm_rank(config, share.loaded.spec, runner, kv_cache, lambda: link.wait_step(link.end_step()))
        except Exception:
            link.close("warm-up steps failed")
            raise
        finally:
            runner.warming = False
    return AttentionRole(share.loaded, kv_cache, link, runner, share.device)


def build_attention(config: AFDConfig, cache_tokens, instruments: StepInstruments = StepInstruments()) -> AttentionRole:
    """Attention rank `config.rank`: its weights, a KV cache of `cache_tokens` (an int, or a callable
    that sizes it from the loaded model and the free device memory), a handshaken FFN link, and
    what its runner reports to (`metrics.wiring.attention_instruments`)."""
    share = load_share(config)
    dtype = torch_dtype(share.dtype)
    tokens = cache_tokens(share.loaded) if callable(cache_tokens) else cache_tokens
    kv_cache = KVCache.for_tokens(share.loaded.model.kv_layouts(), tokens, dtype, share.device)
    log.info("attention rank %d: KV cache of %d tokens (%d blocks of %d), %.2f GiB, %d bytes per token",
             config.rank, kv_cache.capacity_tokens, kv_cache.num_blocks, kv_cache.block_size, kv_cache.nbytes / 2**30,
             KVCache.bytes_per_token(kv_cache.layouts, dtype))
    return assemble_attention(config, share, kv_cache, instruments)
