"""The front door of `afd up`: one OpenAI URL spreading requests over the attention ranks.

Each request goes to the healthy attention rank with the fewest requests in flight;
responses (streamed or not) are relayed as they come. A rank that refuses the
connection is skipped; with none left the client gets an OpenAI-style 503.
"""

from __future__ import annotations

from typing import Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from afd.server.protocol import error_response

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "host"}


class Backends:
    """Attention rank URLs and their in-flight counts."""

    def __init__(self, urls: Callable[[], list[str]]):
        self.urls = urls
        self.in_flight: dict[str, int] = {}

    def order(self) -> list[str]:
        return sorted(self.urls(), key=lambda url: self.in_flight.get(url, 0))


def create_front_app(backends: Backends) -> FastAPI:
    app = FastAPI(title="AFD local deployment", docs_url=None, redoc_url=None)
    # Pooled connections expire before the ranks' keep-alive (30 s) closes them, so a request
    # is never written into a connection the server is closing at that moment.
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                               limits=httpx.Limits(max_connections=None, keepalive_expiry=2.0))

    @app.get("/health")
    async def health() -> JSONResponse:
        states = {}
        for url in backends.urls():
            try:
                states[url] = (await client.get(f"{url}/health")).status_code == 200
            except httpx.HTTPError:
                states[url] = False
        ok = bool(states) and any(states.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "attention_ranks": states}, status_code=200 if ok else 503)

    @app.api_route("/v1/{path:path}", methods=["GET", "POST"])
    async def relay(path: str, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        for url in backends.order():
            upstream = client.build_request(request.method, f"{url}/v1/{path}", content=body, headers=headers)
            backends.in_flight[url] = backends.in_flight.get(url, 0) + 1
            try:
                response = await client.send(upstream, stream=True)
            except (httpx.ConnectError, httpx.RemoteProtocolError):
                backends.in_flight[url] -= 1
                continue  # that rank is down, restarting, or closed the connection: try the next one
            return StreamingResponse(
                _relay_body(response, backends, url),
                status_code=response.status_code,
                headers={k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS},
            )
        return error_response(503, "no attention rank is reachable")

    @app.on_event("shutdown")
    async def _close() -> None:
        await client.aclose()

    return app


async def _relay_body(response: httpx.Response, backends: Backends, url: str):
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    finally:
        backends.in_flight[url] -= 1
        await response.aclose()
