"""How a serving attention rank ends: stop the probes and the engine, exit when the engine thread died.

Shared by `run` (HTTP in this process) and `api_process` (HTTP in child processes); light, so
an API child may import it."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from afd.config import GroupSettings

if TYPE_CHECKING:  # the engine (torch) stays out of the API child processes
    from afd.engine.engine import Engine

log = logging.getLogger(__name__)


def stop_serving(group: GroupSettings, engine: Engine, probe) -> None:
    """After the HTTP server: the probes go, and the engine stops, failing what the grace did not finish."""
    log.info("%s rank %d stopping: %d running, %d waiting requests", group.role, group.rank, engine.num_running,
             engine.num_waiting)
    probe.shutdown()
    engine.stop()


def engine_died(group: GroupSettings, engine: Engine) -> bool:
    """Whether the engine thread died (logged: the process then exits non-zero and is restarted)."""
    if engine.dead:
        log.error("%s rank %d exits because %s (a supervisor or the kubelet restarts it)", group.role, group.rank, engine.dead)
    return engine.dead is not None


def exit_if_engine_dies(engine: Engine, server, stop: threading.Event) -> None:
    """A dead engine thread cannot come back: stop serving so the process exits and is restarted."""
    while not stop.wait(0.5):
        if engine.dead:
            server.should_exit = True
            return
