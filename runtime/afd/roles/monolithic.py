"""The monolithic role: the whole model in one process (FFN local), behind the same engine and API.

`AFD_ROLE=monolithic` (`afd up --monolithic`, `afd generate --monolithic`) is the baseline
users A/B an AFD group against: same checkpoint, same scheduler, sampler and HTTP server,
same decode graphs (`AFD_CUDA_GRAPHS=true` on a GPU), no FFN peer and no connector.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from afd.config import AFDConfig
from afd.engine.offline import generate_with_engine
from afd.engine.generation import GenerationResult
from afd.kv.cache import DEFAULT_BLOCK_SIZE, KVCache
from afd.metrics.wiring import export_resident_bytes, watched_registry
from afd.models.kv_dtype import cache_dtype
from afd.models.loader import LoadedModel, load_model
from afd.models.moe_prep import warm_up
from afd.roles.kv_sizing import serving_cache_tokens
from afd.runners.device import resolve_device, resolve_dtype, torch_dtype
from afd.runners.monolithic_runner import MonolithicRunner
from afd.runners.warm_steps import warm_rank
from afd.server.serve.engine_api import build_server, serve_api

log = logging.getLogger(__name__)


@dataclass
class MonolithicRole:
    """A loaded monolithic rank: model, KV cache and its stepper; no FFN link."""

    loaded: LoadedModel
    kv_cache: KVCache
    runner: MonolithicRunner
    device: torch.device
    link = None  # no FFN peer: nothing to drain or reconnect

    def close(self, reason: str = "shutdown") -> None:
        if self.runner.graphs is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.runner.graphs = self.runner.mixed_graphs = None
        log.info("monolithic rank closed (%s)", reason)


def build_monolithic(config: AFDConfig, cache_tokens: int | None = None,
                     device: torch.device | None = None) -> MonolithicRole:
    """The whole model on `device` (None: the config's); a KV cache of `cache_tokens` (None: sized for serving,
    `afd.roles.kv_sizing`)."""
    scheduler, graphs = config.scheduler, config.graphs
    device = resolve_device(config.load) if device is None else device
    dtype = resolve_dtype(config.load, device)
    loaded = load_model(config.load.model, "monolithic", config.split.gate_on_attention, torch_dtype(dtype), device)
    if device.type == "cuda":
        warm_up(loaded.model)
    if cache_tokens is None:
        cache_tokens = serving_cache_tokens("monolithic", config.kv, scheduler, config.split, graphs, loaded, device,
                                            torch_dtype(dtype))
    kv_cache = KVCache.for_tokens(loaded.model.kv_layouts(), cache_tokens,
                                  cache_dtype(config.kv.kv_cache_dtype, torch_dtype(dtype)), device)
    log.info("monolithic rank: KV cache of %d tokens (%d blocks of %d), %.2f GiB, %s",
             kv_cache.capacity_tokens, kv_cache.num_blocks, kv_cache.block_size, kv_cache.nbytes / 2**30,
             kv_cache.dtype)
    runner = MonolithicRunner(loaded, kv_cache)
    if graphs.cuda_graphs:
        if device.type == "cuda" and dtype != "float32":
            mixed_tokens = graphs.piecewise_tokens(scheduler.max_num_batched_tokens)
            captured = runner.capture_graphs(min(scheduler.max_num_seqs, kv_cache.num_blocks), mixed_tokens)
            log.info("monolithic rank: decode graphs for %s sequences%s, %.1f MiB", list(captured.buckets),
                     f", piecewise prefill graphs up to {mixed_tokens} tokens" if mixed_tokens else "",
                     captured.memory_bytes / 2**20)
        else:
            log.warning("cuda_graphs is on but disabled here: graphs need a CUDA device and bf16/fp16")
    if device.type == "cuda":  # Triton compiles what prompt steps meet now, not while serving
        warm_rank(scheduler, graphs, loaded.spec, runner, kv_cache)
    return MonolithicRole(loaded, kv_cache, runner, device)


def serve_monolithic(config: AFDConfig, stop: threading.Event) -> int:
    """`afd serve` with `AFD_ROLE=monolithic`: the whole model behind the engine and the HTTP API until `stop` is
    set; the exit code."""
    registry = watched_registry(config.group)
    log.info("monolithic rank: loading %s", config.load.model)
    role = build_monolithic(config)
    state, engine = build_server(config, role, registry)
    export_resident_bytes(registry, config.group, role.loaded.resident_bytes)
    return serve_api(config, stop, role, state, engine)


def generate_monolithic(config: AFDConfig, prompts: Sequence[Sequence[int]], max_tokens: int,
                        ignore_eos: bool) -> GenerationResult:
    """Greedy generation of `prompts` as one batch in this process (`afd generate --monolithic`)."""
    role = build_monolithic(config, sum(len(p) + max_tokens + DEFAULT_BLOCK_SIZE for p in prompts))
    try:
        return generate_with_engine(role.runner, role.kv_cache, prompts, max_tokens, role.loaded.spec.eos_token_ids,
                                    ignore_eos, role.device)
    finally:
        role.close("generation done")
