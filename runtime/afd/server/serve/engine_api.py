"""The engine and its HTTP API around a loaded rank (`afd.roles.attention`, `afd.roles.monolithic`): the engine
and the app's state (`build_server`), the probes, and serving until stopped (`serve_api`). The rank's own series
(its link, its weights) are its role builder's (`afd.metrics.wiring`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry

from afd.config import AFDConfig, config_to_env
from afd.engine.engine import Engine
from afd.engine.text.tokenizer import load_tokenizer
from afd.kernels.compile_watch import WATCH
from afd.server.api.api_keys import ApiKeys
from afd.server.api.app import ServerState, create_app, http_server
from afd.server.api.parser_choice import tool_parser_for
from afd.server.api.reasoning import PARSERS
from afd.server.api.validation import Limits
from afd.server.api_process.core import serve_with_api_process
from afd.server.front.failover import Failover, FailoverSettings
from afd.server.lifecycle import engine_died, exit_if_engine_dies, stop_serving
from afd.server.probe_http import DrainWatch, Probes, start_probe_server
from afd.server.serve.ceiling import export_ceiling
from afd.server.serve.serving_metrics import ServingMetrics

log = logging.getLogger(__name__)


def build_server(config: AFDConfig, role, registry: CollectorRegistry | None = None) -> tuple[ServerState, Engine]:
    """Engine + app state around a connected attention role (or a monolithic one), the serving series added to
    `registry` (None: a new one), which may already hold the role's."""
    spec = role.loaded.spec
    group, scheduler, api = config.group, config.scheduler, config.api
    registry = CollectorRegistry() if registry is None else registry
    metrics = ServingMetrics(registry, group.rank, group.role)
    engine = Engine(
        role.runner,
        role.kv_cache,
        load_tokenizer(config.load.model),
        spec.eos_token_ids,
        scheduler.max_num_seqs,
        scheduler.max_model_len_of(spec),
        scheduler.max_num_batched_tokens,
        role.device,
        observer=metrics,
        link=role.link,
        prefill_itl_ratio=scheduler.prefill_itl_ratio,
        prefill_backlog_steps=scheduler.prefill_backlog_steps,
        hold_s=config.link.ffn_hold_s,
        prefix_caching=config.kv.prefix_caching,
        vocab_size=spec.vocab_size,  # the sampler's width: a seeded stream is advanced over it (afd.engine.recovery.carry)
    )
    metrics.track(engine)
    state = ServerState(
        engine=engine,
        tokenizer=engine.tokenizer,
        model_name=api.served_model_name or os.path.basename(os.path.normpath(config.load.model)),
        max_model_len=engine.max_model_len,
        vocab_size=spec.vocab_size,
        health=lambda: engine.problem,
        registry=registry,
        limits=Limits.for_server(api.max_request_bytes, api.max_prompts, api.max_prompt_chars, engine.max_model_len),
        resume_key=group.group_secret.encode(),
        api_keys=ApiKeys(api.api_keys),
        reasoning=PARSERS.get(api.reasoning_parser), reasoning_content=api.reasoning_content,
        tool_parser=tool_parser_for(api.tool_call_parser, config.load.model, engine.tokenizer),
    )
    return state, engine


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


def serve_api(config: AFDConfig, stop: threading.Event, role, state: ServerState, engine: Engine) -> int:
    """Serve the HTTP API of a loaded attention or monolithic `role` and its engine (`build_server`) until `stop`
    is set, in this process or in API processes; the role is closed after; the exit code."""
    group, api = config.group, config.api
    if config.graphs.ceiling_batches:
        export_ceiling(state.registry, group, config.graphs, config.scheduler, role)
    WATCH.set_serving()
    engine.start()
    ffn_draining = lambda: getattr(role.link, "ffn_draining", None)  # noqa: E731
    if api.api_children:  # the HTTP API in child processes (afd.server.api_process)
        try:
            return serve_with_api_process(group, api, config.process, config_to_env(config), stop, state, engine,
                                          lambda listening: attention_probes(state, listening, stop, ffn_draining))
        finally:
            role.close(f"{group.role} rank shutting down")
    # `probes` is bound below, before the server takes its first request
    failover = FailoverSettings(api.failover_url, resume_key=group.group_secret.encode())
    app = Failover(create_app(state), lambda: probes.readiness() is not None, failover)
    server = http_server(app, api, config.process)
    probes = attention_probes(state, lambda: server.started, stop, ffn_draining, app.quiet_s)
    probe = start_probe_server(api.http_host, config.process.metrics_port, probes, state.registry)
    threading.Thread(target=lambda: (stop.wait(), setattr(server, "should_exit", True)), daemon=True).start()
    threading.Thread(target=exit_if_engine_dies, args=(engine, server, stop), name="engine-watch", daemon=True).start()
    log.info("%s rank %d serving on http://%s:%d/v1", group.role, group.rank, api.http_host, api.http_port)
    try:
        server.run()
    finally:
        stop_serving(group, engine, probe)
        role.close(f"{group.role} rank shutting down")
    if engine_died(group, engine):
        return 1
    log.info("%s rank %d stopped", group.role, group.rank)
    return 0
