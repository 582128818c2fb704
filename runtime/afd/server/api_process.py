"""`AFD_API_PROCESS=1`: the HTTP API in child processes, the engine core in `afd serve` (vLLM V1's split).

One Python process shares one GIL between the engine thread, the output thread and the HTTP
event loop; the loop's per-token work (SSE formatting, socket writes) then delays the next
step's launch. Here the core process keeps the model, the FFN link, the engine, its output
thread (sampled tokens, EOS and length), the serving metrics and the probe server; the child
runs uvicorn with the same app (`create_app` behind `Failover`), tokenizes prompts,
detokenizes outputs and finds stop strings, formats events, and talks to the core over
`api_link` / `engine_client`. With `AFD_API_SERVERS=N` there are N such children, each binding
the HTTP port with SO_REUSEPORT, so the kernel spreads connections over N event loops (one
Python process's per-token HTTP work saturates one core near 15,000 tokens/s).

Lifecycle: the core starts the children once its engine runs and is ready when every child says
it listens. SIGTERM to the core is passed to the children, whose uvicorn finishes in-flight
requests within `shutdown_grace_s`; then the core stops. A child that exits on its own is
started again (its requests are aborted in the core; the model, the engine and the other
children keep serving), unless children died `RESTART_LIMIT` times within `RESTART_WINDOW_S`:
then the core exits non-zero and the kubelet restarts the pod. A core that dies takes the
children with it (parent-death signal).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from afd.config import AFDConfig, config_to_env
from afd.server.api_link import ApiLink
from afd.server.core_wire import CoreState
from afd.server.lifecycle import engine_died, stop_serving

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
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


# -- core process -----------------------------------------------------------------------------
def serve_with_api_process(config: AFDConfig, stop: threading.Event, state, engine, probes_for) -> int:
    """Run the API children around the started `engine` (starting again one that ends) until `stop`, a dead
    engine or a spent `RestartBudget`; the exit code.
    `probes_for(listening)` builds the rank's probes (`run.attention_probes`)."""
    from afd.server.probe_http import start_probe_server

    folder = tempfile.mkdtemp(prefix="afd-api-")
    probes = None
    servers = config.api_children
    link = ApiLink(engine, folder, lambda: CoreState(state.health(), probes.readiness() if probes else "starting"),
                   servers)
    state.loop_watch = link  # the probes judge the API's event loops by the children's heartbeats
    probes = probes_for(lambda: link.listening)
    probe = start_probe_server(config.http_host, config.metrics_port, probes, state.registry)
    link.start()
    env = {**os.environ, **config_to_env(config)}
    facts = _facts(config, state, engine, folder)

    def start(api: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "afd.server.api_process", json.dumps({**facts, "api": api})],
                                env=env)

    children = [start(api) for api in range(servers)]
    log.info("%s rank %d: %d API process(es) %s serving on http://%s:%d/v1", config.role, config.rank, servers,
             [child.pid for child in children], config.http_host, config.http_port)
    signalled = False
    try:
        signalled = _supervise(children, start, link, stop, engine, config.shutdown_grace_s)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        stop_serving(config, engine, probe)
        link.close()
        shutil.rmtree(folder, ignore_errors=True)
    if engine_died(config, engine):
        return 1
    ended = [child.returncode for child in children]
    # a child stopped by our SIGTERM before it set its handlers (still starting) ends by the signal: clean too
    if not signalled or any(code not in (0, -signal.SIGTERM) for code in ended):
        log.error("%s rank %d exits because its API processes kept dying (exit codes %s)", config.role, config.rank,
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


def _facts(config: AFDConfig, state, engine, folder: str) -> dict:
    """What the child needs that the config does not say: found while loading the model."""
    host = "127.0.0.1" if config.http_host in ("", "0.0.0.0", "::") else config.http_host
    return {"folder": folder, "core_pid": os.getpid(), "model_name": state.model_name, "max_model_len": state.max_model_len,
            "vocab_size": state.vocab_size, "num_blocks": engine.kv_cache.num_blocks, "block_size": engine.kv_cache.block_size,
            "metrics_url": f"http://{host}:{config.metrics_port}/metrics"}


# -- API process --------------------------------------------------------------------------------
def serve_api(config: AFDConfig, facts: dict) -> int:
    """The child: the app of `afd.server.api.app` on an `EngineClient`, until SIGTERM."""
    from prometheus_client import CollectorRegistry

    from afd.engine.tokenizer import load_tokenizer
    from afd.kv_cache import KVBlocks
    from afd.server.api.app import ServerState, create_app, http_server
    from afd.server.engine_client import EngineClient
    from afd.server.front.failover import Failover, FailoverSettings
    from afd.server.api.validation import Limits

    tokenizer = load_tokenizer(config.model)
    client = EngineClient(facts["folder"], tokenizer, KVBlocks(facts["num_blocks"], facts["block_size"]),
                          config.max_num_seqs, config.max_num_batched_tokens, facts["max_model_len"], api=facts["api"])
    state = ServerState(
        engine=client, tokenizer=tokenizer, model_name=facts["model_name"],
        max_model_len=facts["max_model_len"], vocab_size=facts["vocab_size"], health=lambda: client.problem,
        registry=CollectorRegistry(),
        limits=Limits.for_server(config.max_request_bytes, config.max_prompts, config.max_prompt_chars, facts["max_model_len"]),
        exposition=lambda: urllib.request.urlopen(facts["metrics_url"], timeout=5).read(),  # the core's series
    )
    app = Failover(create_app(state), lambda: client.unready() is not None, FailoverSettings(
        config.failover_url, resume_key=config.group_secret.encode()))
    server = http_server(app, config)
    for signum in (signal.SIGTERM, signal.SIGINT):  # uvicorn re-raises the signal it stopped on: exit 0, not by it
        signal.signal(signum, lambda *_: setattr(server, "should_exit", True))

    async def main() -> None:
        # listening (ready, for the core's probe) once the core was heard too: no 503 for the first requests
        link = asyncio.create_task(client.run(lambda: server.started and client.heard is not None, state.loop_watch.problem))
        try:
            # returns on SIGTERM once in-flight requests finished
            await server.serve(sockets=[shared_port(config.http_host, config.http_port)] if config.api_children > 1 else None)
        finally:
            link.cancel()

    asyncio.run(main())
    client.close()
    return 0


def shared_port(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) that the rank's other API processes bind too (SO_REUSEPORT)."""
    family, kind, proto, _, address = socket.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _die_with(core_pid: int) -> None:
    """Get SIGTERM when the core process dies (Linux), and do not start at all if it is already gone."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        log.warning("no parent-death signal on this platform: the API process outlives a crashed core")
    if os.getppid() != core_pid:
        raise SystemExit("the engine core is gone")


def main(argv: list[str]) -> int:
    from afd.config import load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s api %(name)s: %(message)s")
    facts = json.loads(argv[1])
    _die_with(facts["core_pid"])
    return serve_api(load_config(), facts)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
