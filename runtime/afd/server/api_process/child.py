"""An API process (`AFD_API_PROCESS=1`, started by `afd.server.api_process.core`): uvicorn with the rank's app
(`create_app` behind `Failover`) on an `EngineClient` that talks to the engine core; it tokenizes, detokenizes,
finds stop strings and formats events. It exits at once when the core dies (parent-death signal: its connections
are cut, so relays move their streams) and on SIGTERM once its in-flight requests finished."""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import socket
import urllib.request

from afd.config import ApiSettings, GroupSettings, LoadSettings, ProcessSettings, SchedulerSettings, load_config

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def serve_api(load: LoadSettings, scheduler: SchedulerSettings, api: ApiSettings, process: ProcessSettings,
              group: GroupSettings, facts: dict) -> int:
    """The child: the app of `afd.server.api.app` on an `EngineClient`, until SIGTERM."""
    # local import: after `_die_with`, so a child whose core is already gone exits before loading the app stack
    from prometheus_client import CollectorRegistry

    from afd.engine.text.tokenizer import load_tokenizer
    from afd.kv.cache import KVBlocks
    from afd.server.api.api_keys import ApiKeys
    from afd.server.api.app import ServerState, create_app, http_server
    from afd.server.api.parser_choice import tool_parser_for
    from afd.server.api.reasoning import PARSERS
    from afd.server.api.validation import Limits
    from afd.server.api_process.engine_client import EngineClient
    from afd.server.front.failover import Failover, FailoverSettings

    tokenizer = load_tokenizer(load.model)
    client = EngineClient(facts["folder"], tokenizer, KVBlocks(facts["num_blocks"], facts["block_size"]),
                          scheduler.max_num_seqs, scheduler.max_num_batched_tokens, facts["max_model_len"],
                          api=facts["api"])
    state = ServerState(
        engine=client, tokenizer=tokenizer, model_name=facts["model_name"],
        max_model_len=facts["max_model_len"], vocab_size=facts["vocab_size"], health=lambda: client.problem,
        registry=CollectorRegistry(),
        limits=Limits.for_server(api.max_request_bytes, api.max_prompts, api.max_prompt_chars, facts["max_model_len"]),
        exposition=lambda: urllib.request.urlopen(facts["metrics_url"], timeout=5).read(),  # the core's series
        api_keys=ApiKeys(api.api_keys),
        reasoning=PARSERS.get(api.reasoning_parser), reasoning_content=api.reasoning_content,
        resume_key=group.group_secret.encode(),  # streams moved here from a lost rank (the core takes their tokens)
        tool_parser=tool_parser_for(api.tool_call_parser, load.model, tokenizer),
    )
    app = Failover(create_app(state), lambda: client.unready() is not None, FailoverSettings(
        api.failover_url, resume_key=group.group_secret.encode()))
    server = http_server(app, api, process)
    for signum in (signal.SIGTERM, signal.SIGINT):  # uvicorn re-raises the signal it stopped on: exit 0, not by it
        signal.signal(signum, lambda *_: setattr(server, "should_exit", True))

    async def main() -> None:
        # listening (ready, for the core's probe) once the core was heard too: no 503 for the first requests
        link = asyncio.create_task(client.run(lambda: server.started and client.heard is not None, state.loop_watch.problem))
        orphan = asyncio.create_task(_exit_with(facts["core_pid"]))
        try:
            # returns on SIGTERM once in-flight requests finished
            await server.serve(sockets=[shared_port(api.http_host, api.http_port)] if api.api_children > 1 else None)
        finally:
            link.cancel()
            orphan.cancel()

    asyncio.run(main())
    client.close()
    return 0


async def _exit_with(core_pid: int, every_s: float = 0.1) -> None:
    """Exit at once when the core dies (this process is handed to another parent): every client connection is cut,
    so a relay (the front door, the router, a failover) moves its streams to another rank, instead of each client
    getting an error event once the core is found silent. (uvicorn's own SIGTERM handling would wait for them.)"""
    while os.getppid() == core_pid:
        await asyncio.sleep(every_s)
    log.warning("the engine core is gone: closing every connection now so that relays move their streams")
    os._exit(1)


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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s api %(name)s: %(message)s")
    facts = json.loads(argv[1])
    _die_with(facts["core_pid"])
    config = load_config()  # the rank's settings, from the environment the core gave this process
    return serve_api(config.load, config.scheduler, config.api, config.process, config.group, facts)
