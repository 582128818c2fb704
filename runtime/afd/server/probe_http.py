"""A small HTTP endpoint for `/health` and `/metrics` beside a role (the FFN has no API server).

Kubernetes probes `/health`; Prometheus scrapes `/metrics`. Runs in a daemon thread.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def start_probe_server(
    host: str, port: int, health: Callable[[], str | None], registry: CollectorRegistry
) -> ThreadingHTTPServer:
    """Serve `/health` (200, or 503 with the reason) and `/metrics` on `host:port`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            if self.path == "/health":
                reason = health()
                body = json.dumps({"status": "ok"} if reason is None else {"status": "unavailable", "reason": reason})
                self._reply(200 if reason is None else 503, body.encode(), "application/json")
            elif self.path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            else:
                self._reply(404, b'{"error": "not found"}', "application/json")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # probes every few seconds would flood the log
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="probe-http", daemon=True).start()
    return server
