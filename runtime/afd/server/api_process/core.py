"""The engine core's side of the API-process split (`afd.server.api_process`): start the API children around the
running engine, start again one that dies (within a `RestartBudget`), pass a stop on to them."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from typing import Mapping

from afd.config import ApiSettings, GroupSettings, ProcessSettings
from afd.server.api_process.core_link import ApiLink
from afd.server.api_process.core_wire import CoreState
from afd.server.lifecycle import engine_died, stop_serving
from afd.server.probe_http import start_probe_server

log = logging.getLogger(__name__)
RESTART_LIMIT = 5  # API process deaths within RESTART_WINDOW_S after which the core gives up (exit 1)
RESTART_WINDOW_S = 60.0


class RestartBudget:
    """Whether one more restart is allowed: fewer than `limit` deaths within the last `window_s` (pure)."""

    def __init__(self, limit: int = RESTART_LIMIT, window_s: float = RESTART_WINDOW_S):
        self.limit, self.window_s = limit, window_s
        self.deaths: list[float] = []

    def allow(self, now: float) -> bool:
        """Record a death at `now`; False once `limit` of them fall within the window."""
        self.deaths = [t for t in self.deaths if now - t < self.window_s] + [now]
        return len(self.deaths) < self.limit


def serve_with_api_process(group: GroupSettings, api: ApiSettings, process: ProcessSettings,
                           child_env: Mapping[str, str], stop: threading.Event, state, engine, probes_for) -> int:
    """Run the API children around the started `engine` (starting again one that ends) until `stop`, a dead
    engine or a spent `RestartBudget`; the exit code. Each child starts with `child_env` over this process's
    environment (the rank's settings: `afd.config.config_to_env`).
    `probes_for(listening)` builds the rank's probes (`run.attention_probes`)."""
    folder = tempfile.mkdtemp(prefix="afd-api-")
    probes = None
    servers = api.api_children
    link = ApiLink(engine, folder, lambda: CoreState(state.health(), probes.readiness() if probes else "starting"),
                   servers)
    state.loop_watch = link  # the probes judge the API's event loops by the children's heartbeats
    probes = probes_for(lambda: link.listening)
    probe = start_probe_server(api.http_host, process.metrics_port, probes, state.registry)
    link.start()
    env = {**os.environ, **child_env}
    facts = _facts(api, process, state, engine, folder)

    def start(api: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "afd.server.api_process", json.dumps({**facts, "api": api})],
                                env=env)

    children = [start(api) for api in range(servers)]
    log.info("%s rank %d: %d API process(es) %s serving on http://%s:%d/v1", group.role, group.rank, servers,
             [child.pid for child in children], api.http_host, api.http_port)
    signalled = False
    try:
        signalled = _supervise(children, start, link, stop, engine, process.shutdown_grace_s)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        stop_serving(group, engine, probe)
        link.close()
        shutil.rmtree(folder, ignore_errors=True)
    if engine_died(group, engine):
        return 1
    ended = [child.returncode for child in children]
    # a child stopped by our SIGTERM before it set its handlers (still starting) ends by the signal: clean too
    if not signalled or any(code not in (0, -signal.SIGTERM) for code in ended):
        log.error("%s rank %d exits because its API processes kept dying (exit codes %s)", group.role, group.rank,
                  ended)
        return 1
    return 0


def _supervise(children: list[subprocess.Popen], start, link: ApiLink, stop: threading.Event, engine,
               grace_s: float) -> bool:
    """Watch the children: start again one that ends on its own (within the `RestartBudget`); pass on a stop,
    a dead engine or a spent budget as SIGTERM to them all. Whether the core asked them to stop."""
    deadline, asked, budget = None, False, RestartBudget()
    while any(child.poll() is None for child in children) or deadline is None:
        if deadline is None and not stop.is_set():
            for api, child in enumerate(children):
                if child.poll() is None:
                    continue
                link.forget(api)  # its requests end in the core; its socket waits for the next process
                if not budget.allow(time.monotonic()):
                    log.error("API process %d ended with code %s: %d deaths within %.0f s, giving up", api,
                              child.returncode, budget.limit, budget.window_s)
                    break
                children[api] = start(api)
                log.error("API process %d ended with code %s; started it again as process %d", api, child.returncode,
                          children[api].pid)
        if deadline is None and (stop.is_set() or engine.dead or any(child.poll() is not None for child in children)):
            asked = stop.is_set() or bool(engine.dead)
            for child in children:  # uvicorn: no new requests, in-flight ones finish within the grace
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s + 10
        if deadline is not None and time.monotonic() > deadline:
            log.error("the API processes did not stop within %.0f s: killing them", grace_s + 10)
            for child in children:
                if child.poll() is None:
                    child.kill()
        time.sleep(0.2)
    return asked


def _facts(api: ApiSettings, process: ProcessSettings, state, engine, folder: str) -> dict:
    """What the child needs that the config does not say: found while loading the model."""
    host = "127.0.0.1" if api.http_host in ("", "0.0.0.0", "::") else api.http_host
    return {"folder": folder, "core_pid": os.getpid(), "model_name": state.model_name, "max_model_len": state.max_model_len,
            "vocab_size": state.vocab_size, "num_blocks": engine.kv_cache.num_blocks, "block_size": engine.kv_cache.block_size,
            "metrics_url": f"http://{host}:{process.metrics_port}/metrics"}
