"""`AFD_API_PROCESS=1`: the HTTP API in a child process, the engine core in `afd serve` (vLLM V1's split).

One Python process shares one GIL between the engine thread, the output thread and the HTTP
event loop; the loop's per-token work (SSE formatting, socket writes) then delays the next
step's launch. Here the core process keeps the model, the FFN link, the engine, its output
thread (sampled tokens, EOS and length), the serving metrics and the probe server; the child
runs uvicorn with the same app (`create_app` behind `Failover`), tokenizes prompts,
detokenizes outputs and finds stop strings, formats events, and talks to the core over
`api_link` / `engine_client`.

Lifecycle: the core starts the child once its engine runs and is ready when the child says
it listens. SIGTERM to the core is passed to the child, whose uvicorn finishes in-flight
requests within `shutdown_grace_s`; then the core stops. A child that exits on its own makes
the core exit non-zero (the kubelet restarts the pod); a core that dies takes the child with
it (parent-death signal).
"""

from __future__ import annotations

import asyncio
import ctypes
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
import urllib.request

from afd.config import AFDConfig, config_to_env
from afd.server.api_link import ApiLink
from afd.server.core_wire import CoreState

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


# -- core process -----------------------------------------------------------------------------
def serve_with_api_process(config: AFDConfig, stop: threading.Event, state, engine, probes_for) -> int:
    """Run the API child around the started `engine` until `stop` or until the child ends; the exit code.
    `probes_for(listening)` builds the rank's probes (`run.attention_probes`)."""
    from afd.server.probe_http import start_probe_server
    from afd.server.run import engine_died, stop_serving

    folder = tempfile.mkdtemp(prefix="afd-api-")
    probes = None
    link = ApiLink(engine, folder, lambda: CoreState(state.health(), probes.readiness() if probes else "starting"))
    state.loop_watch = link  # the probes judge the API's event loop by the child's heartbeats
    probes = probes_for(lambda: link.listening)
    probe = start_probe_server(config.http_host, config.metrics_port, probes, state.registry)
    link.start()
    child = subprocess.Popen([sys.executable, "-m", "afd.server.api_process", json.dumps(_facts(config, state, engine, folder))],
                             env={**os.environ, **config_to_env(config)})
    log.info("%s rank %d: API process %d serving on http://%s:%d/v1", config.role, config.rank, child.pid,
             config.http_host, config.http_port)
    signalled = False
    try:
        signalled = _supervise(child, stop, engine, config.shutdown_grace_s)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        stop_serving(config, engine, probe)
        link.close()
        shutil.rmtree(folder, ignore_errors=True)
    if engine_died(config, engine):
        return 1
    if not signalled or child.returncode != 0:
        log.error("%s rank %d exits because its API process ended with code %s", config.role, config.rank, child.returncode)
        return 1
    return 0


def _supervise(child: subprocess.Popen, stop: threading.Event, engine, grace_s: float) -> bool:
    """Wait for the child; pass on a stop (or a dead engine) as SIGTERM. Whether the core asked it to stop."""
    deadline = None
    while child.poll() is None:
        if deadline is None and (stop.is_set() or engine.dead):
            child.send_signal(signal.SIGTERM)  # uvicorn: no new requests, in-flight ones finish within the grace
            deadline = time.monotonic() + grace_s + 10
        if deadline is not None and time.monotonic() > deadline:
            log.error("the API process did not stop within %.0f s: killing it", grace_s + 10)
            child.kill()
        try:
            child.wait(0.2)
        except subprocess.TimeoutExpired:
            pass
    return deadline is not None


def _facts(config: AFDConfig, state, engine, folder: str) -> dict:
    """What the child needs that the config does not say: found while loading the model."""
    host = "127.0.0.1" if config.http_host in ("", "0.0.0.0", "::") else config.http_host
    return {"folder": folder, "core_pid": os.getpid(), "model_name": state.model_name, "max_model_len": state.max_model_len,
            "vocab_size": state.vocab_size, "num_blocks": engine.kv_cache.num_blocks, "block_size": engine.kv_cache.block_size,
            "metrics_url": f"http://{host}:{config.metrics_port}/metrics"}


# -- API process --------------------------------------------------------------------------------
def serve_api(config: AFDConfig, facts: dict) -> int:
    """The child: the app of `afd.server.app` on an `EngineClient`, until SIGTERM."""
    from prometheus_client import CollectorRegistry

    from afd.engine.tokenizer import load_tokenizer
    from afd.kv_cache import KVBlocks
    from afd.server.app import ServerState, create_app, http_server
    from afd.server.engine_client import EngineClient
    from afd.server.failover import Failover, FailoverSettings
    from afd.server.validation import Limits

    tokenizer = load_tokenizer(config.model)
    client = EngineClient(facts["folder"], tokenizer, KVBlocks(facts["num_blocks"], facts["block_size"]),
                          config.max_num_seqs, config.max_num_batched_tokens, facts["max_model_len"])
    state = ServerState(
        engine=client, tokenizer=tokenizer, model_name=facts["model_name"],
        max_model_len=facts["max_model_len"], vocab_size=facts["vocab_size"], health=lambda: client.problem,
        registry=CollectorRegistry(),
        limits=Limits.for_server(config.max_request_bytes, config.max_prompts, config.max_prompt_chars, facts["max_model_len"]),
        exposition=lambda: urllib.request.urlopen(facts["metrics_url"], timeout=5).read(),  # the core's series
    )
    app = Failover(create_app(state), lambda: client.unready() is not None, FailoverSettings(config.failover_url))
    server = http_server(app, config)
    for signum in (signal.SIGTERM, signal.SIGINT):  # uvicorn re-raises the signal it stopped on: exit 0, not by it
        signal.signal(signum, lambda *_: setattr(server, "should_exit", True))

    async def main() -> None:
        # listening (ready, for the core's probe) once the core was heard too: no 503 for the first requests
        link = asyncio.create_task(client.run(lambda: server.started and client.heard is not None, state.loop_watch.problem))
        try:
            await server.serve()  # returns on SIGTERM once in-flight requests finished
        finally:
            link.cancel()

    asyncio.run(main())
    client.close()
    return 0


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
