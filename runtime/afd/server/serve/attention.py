"""`afd serve` for the attention role: connect to the FFN rank, start the engine, serve HTTP."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import torch
from prometheus_client import CollectorRegistry

from afd.config import AFDConfig
from afd.engine.engine import Engine
from afd.engine.text.tokenizer import load_tokenizer
from afd.kv_budget import CudaMemory, DeviceMemory, graph_margin_bytes, plan_kv_budget, profile_peak
from afd.kernels.compile_watch import WATCH
from afd.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from afd.metrics.wiring import attention_instruments, export_kernel_compiles, export_resident_bytes, watch_attention
from afd.models.checkpoint import Checkpoint
from afd.models.spec import parse_spec
from afd.monolithic import build_monolithic
from afd.roles import build_attention
from afd.runners.device import resolve_device, resolve_dtype, torch_dtype
from afd.runners.profile_step import run_largest_steps
from afd.server.api.app import ServerState, create_app, http_server
from afd.server.api.validation import Limits
from afd.server.api_process.core import serve_with_api_process
from afd.server.front.failover import Failover, FailoverSettings
from afd.server.lifecycle import engine_died, exit_if_engine_dies, stop_serving
from afd.server.probe_http import Probes, start_probe_server
from afd.server.serve.ceiling import export_ceiling
from afd.server.serve.serving_metrics import ServingMetrics

log = logging.getLogger(__name__)
DEFAULT_KV_CACHE_BYTES = 1 << 30


def cache_tokens_for(config: AFDConfig, spec) -> int | Callable:
    """KV-cache capacity in tokens: from `kv_cache_bytes` when set (1 GiB on CPU when not); on a GPU, by
    default, a callable that sizes it from the device's free memory once the weights are loaded."""
    device = resolve_device(config)
    dtype = torch_dtype(resolve_dtype(config, device))
    layouts = [spec.kv_layout] * spec.num_layers
    if config.kv_cache_bytes or device.type != "cuda":
        return (config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // KVCache.bytes_per_token(layouts, dtype)
    return lambda loaded: profiled_cache_tokens(config, loaded, CudaMemory(device), dtype, device)


def profiled_cache_tokens(config: AFDConfig, loaded, memory: DeviceMemory, dtype: torch.dtype,
                          device: torch.device) -> int:
    """KV-cache tokens that fit beside the weights and the peak of the largest step, run now (`afd.kv_budget`)."""
    try:
        max_len = config.max_model_len_of(loaded.spec)
        peak = profile_peak(lambda: run_largest_steps(config, loaded, dtype, device, max_len), memory)
    except torch.cuda.OutOfMemoryError as err:
        raise RuntimeError(
            f"the largest step this rank can be given ({config.max_num_batched_tokens} tokens over up to "
            f"{config.max_num_seqs} sequences) does not fit in GPU memory beside the weights: lower "
            f"max_num_batched_tokens or max_num_seqs ({err})") from None
    per_token = KVCache.bytes_per_token(loaded.model.kv_layouts(), dtype)
    if config.cuda_graphs:  # the decode graphs' block tables grow with the cache
        per_token += 4 * config.max_num_seqs // DEFAULT_BLOCK_SIZE + 1
    mixed_tokens = config.piecewise_graph_tokens
    budget = plan_kv_budget(memory, config.gpu_memory_utilization, peak, per_token, graph_margin_bytes(mixed_tokens))
    log.info("KV cache sized from the GPU (activation peak of a %d-token step): %s", config.max_num_batched_tokens,
             budget.describe(per_token))
    if budget.held_bytes > 1 << 30:
        log.warning("the CUDA caching allocator holds %.1f GiB that no tensor uses (fragments left by loading): the KV "
                    "cache cannot take them", budget.held_bytes / 2**30)
    return budget.tokens


def build_server(config: AFDConfig, role, registry: CollectorRegistry | None = None) -> tuple[ServerState, Engine]:
    """Engine + app state around a connected attention role (or a monolithic one); `registry`
    already holds the series the role was built with, if any."""
    spec = role.loaded.spec
    registry = CollectorRegistry() if registry is None else registry
    metrics = ServingMetrics(registry, config.rank, config.role)
    engine = Engine(
        role.runner,
        role.kv_cache,
        load_tokenizer(config.model),
        spec.eos_token_ids,
        config.max_num_seqs,
        config.max_model_len_of(spec),
        config.max_num_batched_tokens,
        role.device,
        observer=metrics,
        link=role.link,
        prefill_itl_ratio=config.prefill_itl_ratio,
        prefill_backlog_steps=config.prefill_backlog_steps,
        hold_s=config.ffn_hold_s,
        vocab_size=spec.vocab_size,  # the sampler's width: a seeded stream is advanced over it (afd.engine.recovery.carry)
    )
    metrics.track(engine)
    state = ServerState(
        engine=engine,
        tokenizer=engine.tokenizer,
        model_name=config.served_model_name or os.path.basename(os.path.normpath(config.model)),
        max_model_len=engine.max_model_len,
        vocab_size=spec.vocab_size,
        health=lambda: engine.problem,
        registry=registry,
        limits=Limits.for_server(config.max_request_bytes, config.max_prompts, config.max_prompt_chars, engine.max_model_len),
        resume_key=config.group_secret.encode(),
    )
    if role.link is not None:  # a monolithic rank has no FFN link
        watch_attention(registry, config, role, engine)
    loaded = getattr(role, "loaded", None)
    if loaded is not None:
        export_resident_bytes(registry, config, loaded.resident_bytes)
    return state, engine


ENDPOINT_SPREAD_S = 5.0  # the operator's DRAIN_SECONDS: the endpoint removal reaches every proxy within it
QUIET_S = 1.0  # no HTTP request for this long: every client connection has been answered with `Connection: close`


class DrainWatch:
    """When an attention rank's preStop drain may end (issue 38): once the endpoint removal has had
    ENDPOINT_SPREAD_S to spread and no HTTP request has run for QUIET_S. Until then the rank serves on
    (held requests included, should its FFN come back), answering with `Connection: close`: every
    closed-loop client's connection gets one such answer, so the stop that follows never closes a
    keep-alive connection a client is just sending on (a reset request). `quiet_s`: None when the API
    runs elsewhere (api children): the drain ends after ENDPOINT_SPREAD_S."""

    def __init__(self, quiet_s: Callable[[], float] | None, clock: Callable[[], float] = time.monotonic):
        self.quiet_s, self.clock, self.started = quiet_s, clock, None

    def begin(self) -> None:
        if self.started is None:
            self.started = self.clock()

    def drained(self) -> bool:
        if self.started is None or self.clock() - self.started < ENDPOINT_SPREAD_S:
            return False
        return self.quiet_s is None or self.quiet_s() >= QUIET_S


def attention_probes(state: ServerState, listening: Callable[[], bool], stop: threading.Event,
                     ffn_draining: Callable[[], str | None] = lambda: None,
                     quiet_s: Callable[[], float] | None = None) -> Probes:
    """Readiness follows the FFN link at once; liveness fails only when the rank cannot serve at all.

    A rank whose FFN is gone is unready (it answers 503) but alive: it re-handshakes when
    the FFN returns, so the kubelet must not restart it. An FFN rank about to stop says so
    (wire.Draining): the rank turns unready and finishes what it runs while the FFN waits.
    The preStop drain keeps serving while the endpoint removal reaches every proxy, then until
    no request runs (`DrainWatch`), within the hook's time.
    """
    engine = state.engine

    def ready() -> str | None:
        if stop.is_set():
            return "shutting down"
        if not listening():
            return "the HTTP server is not listening yet"
        return state.problem() or ffn_draining()

    def live() -> str | None:
        problem = engine.problem  # the engine's death, or the FFN link (engine.error): only the first is fatal
        if problem is not None and problem == engine.error:
            problem = None
        return problem or state.loop_watch.problem()

    watch = DrainWatch(quiet_s)
    return Probes(ready, live, drained=watch.drained, on_drain=watch.begin)


def build_role(config: AFDConfig, registry: CollectorRegistry):
    """The loaded role: the whole model (monolithic: no split step to time), or an attention rank connected to its
    FFN rank, its step timed into `registry`."""
    tokens = cache_tokens_for(config, parse_spec(Checkpoint(config.model).config))
    if config.role == "monolithic":
        log.info("monolithic rank: loading %s", config.model)
        return build_monolithic(config, tokens)
    log.info("attention rank %d: loading %s and connecting to ffn rank %d",
             config.rank, config.model, config.topology.ffn_rank_of(config.rank))
    return build_attention(config, tokens, attention_instruments(registry, config, resolve_device(config)))


def serve_attention(config: AFDConfig, stop: threading.Event) -> int:
    registry = CollectorRegistry()
    if WATCH.install():  # Triton kernels compiled after warm-up are logged and counted
        export_kernel_compiles(registry, config, WATCH)
    role = build_role(config, registry)
    state, engine = build_server(config, role, registry)
    if config.ceiling_batches:
        export_ceiling(state.registry, config, role)
    WATCH.set_serving()
    engine.start()
    ffn_draining = lambda: getattr(role.link, "ffn_draining", None)  # noqa: E731
    if config.api_children:  # the HTTP API in child processes (afd.server.api_process)
        try:
            return serve_with_api_process(config, stop, state, engine,
                                          lambda listening: attention_probes(state, listening, stop, ffn_draining))
        finally:
            role.close(f"{config.role} rank shutting down")
    # `probes` is bound below, before the server takes its first request
    failover = FailoverSettings(config.failover_url, resume_key=config.group_secret.encode())
    app = Failover(create_app(state), lambda: probes.readiness() is not None, failover)
    server = http_server(app, config)
    probes = attention_probes(state, lambda: server.started, stop, ffn_draining, app.quiet_s)
    probe = start_probe_server(config.http_host, config.metrics_port, probes, state.registry)
    threading.Thread(target=lambda: (stop.wait(), setattr(server, "should_exit", True)), daemon=True).start()
    threading.Thread(target=exit_if_engine_dies, args=(engine, server, stop), name="engine-watch", daemon=True).start()
    log.info("%s rank %d serving on http://%s:%d/v1", config.role, config.rank, config.http_host, config.http_port)
    try:
        server.run()
    finally:
        stop_serving(config, engine, probe)
        role.close(f"{config.role} rank shutting down")
    if engine_died(config, engine):
        return 1
    log.info("%s rank %d stopped", config.role, config.rank)
    return 0
