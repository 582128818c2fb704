"""A small HTTP endpoint for the kubelet's probes and Prometheus, beside a role. Runs in a daemon thread.

Separate from the API server (the FFN has none; on attention a busy event loop must not
make a probe time out). Endpoints:

- `/health`  readiness: 200, or 503 with the reason (warming up, FFN link lost, draining,
  shutting down). The attention pod's readiness probe runs every second, so a group
  whose FFN is gone leaves the client Service within about a second.
- `/live`    liveness: 503 only when the process can no longer serve at all (the engine
  thread died). A lost FFN link is *not* a liveness failure: the rank is waiting to
  re-handshake, and a restart would only throw away its warm state.
- `/drain?seconds=N`  the preStop hook: readiness turns 503 at once (the pod leaves the
  Service endpoints) while the server keeps serving; answers 200 after N seconds, or
  earlier once `drained()` says there is nothing left to wait for. The kubelet sends
  SIGTERM only after the hook returns.
- `/metrics` Prometheus.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)
Reason = Callable[[], "str | None"]  # None when fine, else why not
MAX_DRAIN_S = 3600.0


class Probes:
    """What the probe endpoints answer: readiness, liveness, and the drain before a stop."""

    def __init__(self, ready: Reason, live: Reason = lambda: None, drained: Callable[[], bool] = lambda: False,
                 on_drain: Callable[[], None] = lambda: None):
        self._ready = ready
        self._live = live
        self._drained = drained  # True once a drain need not wait any longer (e.g. no peer left)
        self._on_drain = on_drain  # called when a drain begins
        self.draining = threading.Event()

    def readiness(self) -> str | None:
        if self.draining.is_set():
            return "draining: the pod is stopping"
        return self._ready()

    def liveness(self) -> str | None:
        return self._live()

    def drain(self, seconds: float) -> float:
        """Turn unready now, keep serving; return after `seconds` or once drained. Seconds waited."""
        self.draining.set()
        self._on_drain()
        started = time.monotonic()
        deadline = started + seconds
        while time.monotonic() < deadline and not self._drained():
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return time.monotonic() - started


ENDPOINT_SPREAD_S = 5.0  # the operator's DRAIN_SECONDS: the endpoint removal reaches every proxy within it
QUIET_S = 1.0  # no HTTP request for this long: every client connection has been answered with `Connection: close`


class DrainWatch:
    """When a pod's preStop drain (an attention rank's, issue 38, or the router's) may end: once the endpoint removal
    has had ENDPOINT_SPREAD_S to spread and no HTTP request has run for QUIET_S. Until then the pod serves on
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


def drain_seconds(query: str) -> float:
    """`seconds` of a `/drain` query string; ValueError with the reason if absent or invalid."""
    values = parse_qs(query).get("seconds")
    if not values:
        raise ValueError("/drain needs ?seconds=N")
    try:
        seconds = float(values[0])
    except ValueError:
        raise ValueError(f"/drain: seconds={values[0]!r} is not a number") from None
    if not 0 <= seconds <= MAX_DRAIN_S:
        raise ValueError(f"/drain: seconds={seconds:g} must be in 0..{MAX_DRAIN_S:g}")
    return seconds


def start_probe_server(
    host: str, port: int, health: Reason | Probes, registry: CollectorRegistry
) -> ThreadingHTTPServer:
    """Serve the probes (a `Probes`, or a bare readiness callable) and `/metrics` on `host:port`."""
    probes = health if isinstance(health, Probes) else Probes(health)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            url = urlsplit(self.path)
            if url.path == "/health":
                self._status(probes.readiness())
            elif url.path == "/live":
                self._status(probes.liveness())
            elif url.path == "/drain":
                self._drain(url.query)
            elif url.path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            else:
                self._reply(404, b'{"error": "not found"}', "application/json")

        def _status(self, reason: str | None) -> None:
            body = {"status": "ok"} if reason is None else {"status": "unavailable", "reason": reason}
            self._reply(200 if reason is None else 503, json.dumps(body).encode(), "application/json")

        def _drain(self, query: str) -> None:
            try:
                seconds = drain_seconds(query)
            except ValueError as err:
                self._reply(400, json.dumps({"error": str(err)}).encode(), "application/json")
                return
            log.info("preStop drain: readiness is 503 now; serving on for up to %.0f s", seconds)
            waited = probes.drain(seconds)
            log.info("preStop drain done after %.1f s", waited)
            self._reply(200, json.dumps({"status": "drained", "waited_s": round(waited, 3)}).encode(), "application/json")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # probes every second would flood the log
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="probe-http", daemon=True).start()
    return server
