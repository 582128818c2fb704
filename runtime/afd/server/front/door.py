"""The front door of `afd up`: one OpenAI URL spreading requests over the attention ranks.

Each request goes to the rank most likely to hold its prefix in its KV cache, unless that rank is much busier than
the least-loaded one (`afd.server.front.prefix_choice`: ranks' readiness and load are polled by
`afd.server.front.rank_watch`); responses (streamed or not) are relayed as they come. A rank that refuses the
connection, or answers 503 (not serving), is skipped; with none left the client gets an
OpenAI-style 503. Bodies are bounded, every call to a rank has a read timeout, and a
client that leaves closes its relay, which the rank sees and aborts at its next step. A stream
whose rank dies mid-stream goes on from another rank (`afd.server.front.splice`); a non-streamed request
whose rank dies is sent to the next rank.
`/metrics` answers the front door's series and every rank's, merged.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from afd.server.api.api_keys import ApiKeys, RequireApiKey
from afd.server.api.http_body import HOP_HEADERS, OWN_HEADERS, BodyTimeout, BodyTooLarge, client_gone, read_body
from afd.server.api.protocol import error_response
from afd.server.api.resume import IDS_HEADER, RESUME_HEADER, Resume, sign
from afd.server.front.failover import RELAYED
from afd.server.front.metrics import FrontMetrics
from afd.server.front.prefix_choice import ChoiceSettings, Chooser, request_hashes
from afd.server.front.rank_watch import RankWatch
from afd.server.front.splice import spliced



@dataclass(frozen=True)
class FrontSettings:
    """Limits of the front door (`afd up` flags)."""

    max_request_bytes: int = 16 << 20
    read_timeout_s: float = 600.0  # longest silence from a rank: a whole non-streamed generation, or between chunks
    probe_timeout_s: float = 2.0  # /health and /metrics of each rank
    shutdown_grace_s: float = 5.0  # SIGTERM: in-flight relays get this long, then are cut
    move_timeout_s: float = 30.0  # a stream whose rank died waits this long for another rank to continue it
    resume_key: bytes = field(default=b"", repr=False)  # the ranks' group secret: signs moved streams; b"": none move
    api_keys: ApiKeys = field(default_factory=ApiKeys)  # the ranks' `api_key`, checked here too (and forwarded)


class Backends:
    """Attention rank URLs, their in-flight counts, polled loads and the prefixes sent to each; every rank's metrics
    URL by name (merged into the front door's `/metrics`). `probe_bases`: rank URL → where its `/health` and
    `/metrics` are (default: the rank URL itself)."""

    def __init__(self, urls: Callable[[], list[str]], metrics_urls: Callable[[], dict[str, str]] = dict,
                 probe_bases: Callable[[], dict[str, str]] | None = None, choice: ChoiceSettings = ChoiceSettings(),
                 watch_interval_s: float = 1.0):
        self.urls = urls
        self.metrics_urls = metrics_urls
        self.in_flight: dict[str, int] = {}
        self.choice = choice
        self.chooser = Chooser(choice)
        self.watch = RankWatch(probe_bases or (lambda: {url: url for url in self.urls()}), lambda: self.in_flight,
                               watch_interval_s)
        self._known: frozenset[str] = frozenset()

    def order(self, hashes: list[bytes] = ()) -> list[str]:
        """The ranks to try for a request keyed by `hashes` (`prefix_choice.request_hashes`), best first."""
        urls = self.urls()
        if self._known != frozenset(urls):  # ranks came or went: forget where the gone ones' prefixes were
            self._known = frozenset(urls)
            self.chooser.prefixes.forget(urls)
        return self.chooser.order(urls, self.watch.loads(urls), list(hashes))

    def served(self, hashes: list[bytes], url: str) -> None:
        """`url` answered a request keyed by `hashes`: it holds that prefix now."""
        if hashes:
            self.chooser.prefixes.record(hashes, url)


def create_front_app(backends: Backends, settings: FrontSettings = FrontSettings()) -> FastAPI:
    app = FastAPI(title="AFD local deployment", docs_url=None, redoc_url=None)
    app.add_middleware(RequireApiKey, keys=settings.api_keys)
    # Pooled connections expire before the ranks' keep-alive (30 s) closes them, so a request
    # is never written into a connection the server is closing at that moment.
    client = httpx.AsyncClient(timeout=httpx.Timeout(settings.read_timeout_s, connect=5.0),
                               limits=httpx.Limits(max_connections=None, keepalive_expiry=2.0))
    metrics = FrontMetrics(lambda: sum(backends.in_flight.values()), backends.metrics_urls())
    app.state.front_metrics = metrics  # `afd route` serves these on its probe port
    watching: list[asyncio.Task] = []

    @app.on_event("startup")
    async def _watch() -> None:
        watching.append(asyncio.create_task(backends.watch.run(client)))

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_: Request, err: BodyTooLarge) -> JSONResponse:
        metrics.count(413)
        return error_response(413, str(err))

    @app.exception_handler(BodyTimeout)
    async def _too_slow(_: Request, err: BodyTimeout) -> JSONResponse:
        metrics.count(408)
        return error_response(408, str(err))

    @app.get("/health")
    async def health() -> JSONResponse:
        urls = backends.urls()
        answers = await asyncio.gather(*(_get(client, f"{url}/health", settings.probe_timeout_s) for url in urls))
        states = {url: answer is not None and answer.status_code == 200 for url, answer in zip(urls, answers)}
        ok = bool(states) and any(states.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "attention_ranks": states}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def merged_metrics() -> Response:
        targets = backends.metrics_urls()
        answers = await asyncio.gather(*(_get(client, url, settings.probe_timeout_s) for url in targets.values()))
        texts = {name: a.text if a is not None and a.status_code == 200 else None for name, a in zip(targets, answers)}
        return Response(metrics.exposition(texts), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/v1/{path:path}", methods=["GET", "POST"])
    async def relay(path: str, request: Request) -> Response:
        return await relay_to(f"/v1/{path}", request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:  # vLLM's, outside /v1
        return await relay_to("/tokenize", request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await relay_to("/detokenize", request)

    async def relay_to(target: str, request: Request) -> Response:
        """`request` answered by the first rank of the choice (its prefix, bounded by load) that serves, at `target`."""
        body = await read_body(request, settings.max_request_bytes)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in HOP_HEADERS and not k.lower().startswith("x-afd-")}
        headers[IDS_HEADER] = "1"  # streams say their token ids, so one can move should its rank die
        headers[RELAYED.decode()] = "1"  # a rank's failover never relays ours: a 503 comes back here, for the next rank
        hashes = _hashes(target, request.method, body, backends.choice)
        gone = asyncio.ensure_future(client_gone(request))
        try:
            urls = backends.order(hashes)
            for index, url in enumerate(urls):
                upstream = client.build_request(request.method, f"{url}{target}", content=body, headers=headers)
                response = await _send(client, upstream, gone, backends, url)
                if response is None:  # the client left: the cancelled send closed the rank's connection
                    metrics.count(None)
                    return Response(status_code=499)
                if isinstance(response, Response):
                    metrics.count(response.status_code)
                    return response
                if response == "skip" or (response.status_code == 503 and index + 1 < len(urls)):
                    if not isinstance(response, str):
                        await _done(response, backends, url)
                    continue  # that rank is down, restarting, not serving, or closed the connection
                metrics.count(response.status_code)
                if response.status_code == 200:
                    backends.served(hashes, url)
                if settings.resume_key and response.status_code == 200 and \
                        response.headers.get("content-type", "").startswith("text/event-stream"):
                    return StreamingResponse(
                        _moving_stream(client, request.method, target, body, headers, response, url, backends,
                                       settings, metrics, hashes),
                        status_code=200,
                        headers={k: v for k, v in response.headers.items() if k.lower() not in OWN_HEADERS},
                    )
                return StreamingResponse(
                    _relay_body(response, backends, url),
                    status_code=response.status_code,
                    headers={k: v for k, v in response.headers.items() if k.lower() not in OWN_HEADERS},
                )
            metrics.count(503)
            return error_response(503, "no attention rank is reachable")
        finally:
            gone.cancel()  # from here on StreamingResponse itself watches for the client leaving

    @app.on_event("shutdown")
    async def _close() -> None:
        for task in watching:
            task.cancel()
        await client.aclose()

    return app


def _hashes(target: str, method: str, body: bytes, choice: ChoiceSettings) -> list[bytes]:
    """The prefix chunk hashes of a generation request (empty for anything else, or a body that is not JSON: the
    rank answers that)."""
    if method != "POST" or target not in ("/v1/chat/completions", "/v1/completions"):
        return []
    try:
        return request_hashes(target, json.loads(body), choice)
    except (ValueError, RecursionError):
        return []


async def _get(client: httpx.AsyncClient, url: str, timeout_s: float) -> httpx.Response | None:
    try:
        return await client.get(url, timeout=timeout_s)
    except httpx.HTTPError:
        return None


async def _send(client, upstream, gone: asyncio.Future, backends: Backends, url: str):
    """The rank's response (headers read), "skip", an error Response, or None if the client left first."""
    backends.in_flight[url] = backends.in_flight.get(url, 0) + 1
    send = asyncio.ensure_future(client.send(upstream, stream=True))
    try:
        await asyncio.wait({send, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # shutdown cut this relay: close the rank's connection too
        send.cancel()
        backends.in_flight[url] -= 1
        raise
    if not send.done():
        send.cancel()
        backends.in_flight[url] -= 1
        return None
    try:
        return send.result()
    except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):
        backends.in_flight[url] -= 1
        return error_response(504, f"the attention rank sent nothing for {client.timeout.read:.0f} s (the front door's read timeout)")
    except httpx.TransportError:  # refused, reset, closed, or no connection within the connect timeout
        backends.in_flight[url] -= 1
        return "skip"


async def _done(response: httpx.Response, backends: Backends, url: str) -> None:
    backends.in_flight[url] -= 1
    await response.aclose()


def _moving_stream(client, method: str, target: str, body: bytes, headers: dict, response: httpx.Response, url: str,
                   backends: Backends, settings: FrontSettings, metrics: FrontMetrics, hashes: list[bytes] = ()):
    """`response`'s stream, moved to another rank each time its rank is lost (`afd.server.front.splice`)."""
    owners = {id(response): url}

    async def reopen(resume: Resume | None) -> httpx.Response | None:
        extra = {RESUME_HEADER: sign(settings.resume_key, resume)} if resume is not None else {}
        never = asyncio.get_running_loop().create_future()  # the client leaving cancels the whole stream instead
        deadline = time.monotonic() + settings.move_timeout_s
        while time.monotonic() < deadline:
            for candidate in backends.order(hashes):
                upstream = client.build_request(method, f"{candidate}{target}", content=body, headers={**headers, **extra})
                answer = await _send(client, upstream, never, backends, candidate)
                if isinstance(answer, httpx.Response):
                    if answer.status_code == 200:
                        owners[id(answer)] = candidate
                        backends.served(list(hashes), candidate)
                        return answer
                    await _done(answer, backends, candidate)
                    if answer.status_code != 503:
                        return None  # refused (a 400 names why in that rank's log): no other rank would differ
            await asyncio.sleep(0.25)  # every rank is down or restarting: wait for one within the deadline
        return None

    async def release(done: httpx.Response) -> None:
        await _done(done, backends, owners.pop(id(done)))

    return spliced(response, reopen, release, metrics.moved)


async def _relay_body(response: httpx.Response, backends: Backends, url: str):
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.TimeoutException:
        pass  # the rank went silent past the read timeout: end the relay, the client sees a cut stream
    finally:
        await _done(response, backends, url)
