"""The attention role: its share of the weights, a KV cache, the link to its FFN rank (one per expert shard), the
runner and its graphs (`build_attention`), behind the engine and the HTTP API (`serve_attention`).

The benchmarks assemble a rank around a share they loaded once (`assemble_attention`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from afd.config import AFDConfig
from afd.connector.attention_link import AttentionLink
from afd.connector.expert_link import ShardedLink
from afd.kv.cache import KVCache
from afd.metrics.layer_clock import StepInstruments
from afd.metrics.wiring import (
    attention_instruments, export_group_info, export_resident_bytes, watch_attention, watched_registry,
)
from afd.models.kv_dtype import cache_dtype
from afd.models.loader import LoadedModel
from afd.roles.kv_sizing import serving_cache_tokens
from afd.roles.share import Share, graphs_usable, load_share
from afd.runners.attention_runner import AttentionRunner, StepOptions
from afd.runners.device import resolve_device, resolve_dtype, torch_dtype
from afd.runners.warm_steps import warm_rank
from afd.server.serve.engine_api import build_server, serve_api

log = logging.getLogger(__name__)


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
    """Attention rank `config.group.rank` around its share and KV cache: handshaken, decode graphs captured."""
    group, scheduler = config.group, config.scheduler
    hello = share.hello(group, config.split, config.link)
    if group.ffn_expert_parallel > 1:  # one link per shard, summed (afd.connector.expert_link)
        link = ShardedLink.connect(group, config.link, hello, share.device)
    else:
        link = AttentionLink.connect(group, config.link, hello, share.device)
    runner = AttentionRunner(share.loaded, link, kv_cache, StepOptions.of(config.split), instruments)
    link.listen(runner)
    if graphs_usable(config.graphs, config.link, share.device, share.dtype):
        try:  # warm-up and capture drive the FFN through their plans; Ready only after this
            mixed_tokens = config.graphs.piecewise_tokens(scheduler.max_num_batched_tokens)
            graphs = runner.capture_graphs(min(scheduler.max_num_seqs, kv_cache.num_blocks), mixed_tokens=mixed_tokens)
        except Exception:
            link.close("graph capture failed")
            raise
        log.info("attention rank %d: decode graphs for %s sequences, %.1f MiB",
                 group.rank, list(graphs.buckets), graphs.memory_bytes / 2**20)
    if share.device.type == "cuda":  # Triton compiles what prompt steps meet now, not while serving
        runner.warming = True  # the FFN counts its own compiles in these steps as warm-up
        try:
            warm_rank(scheduler, config.graphs, share.loaded.spec, runner, kv_cache,
                      lambda: link.wait_step(link.end_step()))
        except Exception:
            link.close("warm-up steps failed")
            raise
        finally:
            runner.warming = False
    return AttentionRole(share.loaded, kv_cache, link, runner, share.device)


def build_attention(config: AFDConfig, cache_tokens: int | None = None, instruments: StepInstruments = StepInstruments(),
                    device: torch.device | None = None) -> AttentionRole:
    """Attention rank `config.group.rank` on `device` (None: the config's): its weights, a KV cache of
    `cache_tokens` (None: sized for serving, `afd.roles.kv_sizing`), a handshaken FFN link, and what its runner
    reports to (`metrics.wiring.attention_instruments`)."""
    device = resolve_device(config.load) if device is None else device
    share = load_share(config.group, config.split, config.load.model, device, resolve_dtype(config.load, device))
    dtype = torch_dtype(share.dtype)
    if cache_tokens is None:
        cache_tokens = serving_cache_tokens("attention", config.kv, config.scheduler, config.split, config.graphs,
                                            share.loaded, share.device, dtype)
    kv_dtype = cache_dtype(config.kv.kv_cache_dtype, dtype)
    kv_cache = KVCache.for_tokens(share.loaded.model.kv_layouts(), cache_tokens, kv_dtype, share.device)
    log.info("attention rank %d: KV cache of %d tokens (%d blocks of %d), %.2f GiB, %d bytes per token (%s)",
             config.group.rank, kv_cache.capacity_tokens, kv_cache.num_blocks, kv_cache.block_size,
             kv_cache.nbytes / 2**30, KVCache.bytes_per_token(kv_cache.layouts, kv_dtype), kv_dtype)
    return assemble_attention(config, share, kv_cache, instruments)


def serve_attention(config: AFDConfig, stop: threading.Event) -> int:
    """`afd serve` on attention rank `config.group.rank`: connected to its FFN rank, its step timed, the HTTP API served
    until `stop` is set; the exit code."""
    group = config.group
    registry = watched_registry(group)
    device = resolve_device(config.load)  # once per process: the instruments, the weights and the KV cache use it
    log.info("attention rank %d: loading %s and connecting to ffn rank %d",
             group.rank, config.load.model, group.topology.ffn_rank_of(group.rank))
    export_group_info(registry, group, config.split, config.link)
    role = build_attention(config, None, attention_instruments(registry, group, config.process, device), device)
    state, engine = build_server(config, role, registry)
    watch_attention(registry, group, role, engine)
    export_resident_bytes(registry, group, role.loaded.resident_bytes)
    return serve_api(config, stop, role, state, engine)
