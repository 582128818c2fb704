"""Failover of an attention rank that cannot serve: its requests go on to another group.

Behind one client Service, a connection is balanced once, when it opens: a client on a
keep-alive connection keeps reaching a rank after the rank has left the Service's endpoints
(kube-proxy's conntrack keeps established connections where they were). So, as ASGI
middleware around the rank's API:

- while the rank is not ready (draining, FFN link lost, FFN about to stop) every response
  carries `Connection: close`: the client's next request opens a new connection, which the
  Service sends to a ready rank;
- an API request this rank answers with 503 before sending anything else (it cannot serve
  now, or the request failed before its first token: a 503 JSON body, or a stream whose first
  event is an error) is relayed to the failover URL (the client Service), retried for a few
  seconds while the Service's endpoints catch up. A relayed request carries `x-afd-failover`
  and is never relayed again, so requests cannot circle.

Client errors (400, 404, 413, ...) are answered here as before: only a 503 moves on. A relayed stream
whose rank dies mid-stream goes on from another rank of the Service (`afd.server.front.splice`), signed with
the group secret; a relayed non-streamed request whose rank dies is sent again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from afd.server.api.http_body import HOP_HEADERS, OWN_HEADERS
from afd.server.api.resume import IDS_HEADER, RESUME_HEADER, Resume, sign
from afd.server.front.splice import spliced

log = logging.getLogger(__name__)
RELAYED = b"x-afd-failover"


@dataclass(frozen=True)
class FailoverSettings:
    url: str = ""  # where requests go on (the client Service); "" only closes connections
    attempts: int = 20  # tries of the failover URL before the client gets the 503
    backoff_s: float = 0.25  # between tries: the Service drops this rank's endpoint meanwhile
    read_timeout_s: float = 600.0
    resume_key: bytes = field(default=b"", repr=False)  # the group secret: a relayed stream cut mid-way moves on


def first_byte_failed(status: int, content_type: str, first_chunk: bytes) -> bool:
    """Whether a response is a refusal or a failure before any token: 503, or a stream whose
    first event is an error."""
    if status == 503:
        return True
    return status == 200 and content_type.startswith("text/event-stream") and first_chunk.startswith(b'data: {"error"')


class Failover:
    """ASGI middleware: `leaving()` says the rank is not ready (close connections)."""

    def __init__(self, app, leaving: Callable[[], bool], settings: FailoverSettings = FailoverSettings(),
                 client: httpx.AsyncClient | None = None):
        self.app, self.leaving, self.settings = app, leaving, settings
        # one pool for every relay, as long as the rank serves
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(settings.read_timeout_s, connect=2.0))
        self.relayed = 0  # requests sent on to the failover URL (tests, logs)
        self.moves = 0  # relayed streams moved on after their rank was lost mid-stream
        self.in_flight = 0  # HTTP requests being answered (a stopping rank waits for none: `quiet_s`)
        self._idle_since = time.monotonic()

    def quiet_s(self) -> float:
        """Seconds since the last HTTP request ended; 0 while one runs."""
        return 0.0 if self.in_flight else time.monotonic() - self._idle_since

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.in_flight += 1
        try:
            await self._answer(scope, receive, _closing(send, self.leaving))
        finally:
            self.in_flight -= 1
            self._idle_since = time.monotonic()

    async def _answer(self, scope, receive, send):
        relay_allowed = (self.settings.url and scope["method"] == "POST" and scope["path"].startswith("/v1/")
                         and RELAYED not in dict(scope["headers"]))
        if not relay_allowed:
            return await self.app(scope, receive, send)
        body: list[bytes] = []
        held = _HeldResponse(send)

        async def receive_and_keep():
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        await self.app(scope, receive_and_keep, held.send)
        if held.failed is not None:
            await self._relay(scope, b"".join(body), send, held.failed)

    async def _relay(self, scope, body: bytes, send, refusal: tuple[dict, bytes]) -> None:
        """Send the request on; the client gets the first answer that is not a 503, else this rank's."""
        target = self.settings.url.rstrip("/") + scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k != RELAYED and k.decode("latin-1").lower() not in HOP_HEADERS
                   and not k.decode("latin-1").lower().startswith("x-afd-")]
        headers += [(RELAYED.decode(), "1"), (IDS_HEADER, "1")]
        response = await self._first_answer(target, body, headers)
        if response is not None:
            self.relayed += 1
            if self.settings.resume_key and response.status_code == 200 and \
                    response.headers.get("content-type", "").startswith("text/event-stream"):
                await _forward(response, send, self._moving(response, target, body, headers))
            else:
                await _forward(response, send)
            return
        start, first = refusal  # nobody else could take it either: the client gets this rank's answer
        await send(start)
        await send({"type": "http.response.body", "body": first, "more_body": False})

    async def _first_answer(self, target: str, body: bytes, headers: list, ok=lambda status: status != 503):
        """The failover URL's first answer whose status is `ok` (a streaming response), or None after every try."""
        client = self.client
        for _ in range(self.settings.attempts):
            try:
                response = await client.send(client.build_request("POST", target, content=body, headers=headers), stream=True)
            except httpx.TransportError as err:  # refused, or the rank died before answering: try again
                log.debug("failover to %s: %s", target, err)
            else:
                if ok(response.status_code):
                    return response
                await response.aclose()
                if response.status_code != 503:
                    return None
            await asyncio.sleep(self.settings.backoff_s)
        return None

    def _moving(self, response: httpx.Response, target: str, body: bytes, headers: list):
        """`response`'s stream, moved on through the failover URL each time its rank is lost."""

        async def reopen(resume: Resume | None) -> httpx.Response | None:
            extra = [(RESUME_HEADER, sign(self.settings.resume_key, resume))] if resume is not None else []
            return await self._first_answer(target, body, headers + extra, ok=lambda status: status == 200)

        async def release(done: httpx.Response) -> None:
            await done.aclose()

        return spliced(response, reopen, release, self.moved)

    def moved(self, seconds: float) -> None:
        """A relayed stream moved to another rank after `seconds` (counted for tests and logs)."""
        self.moves += 1
        log.info("a relayed stream moved to another attention rank after %.2f s", seconds)


class _HeldResponse:
    """Holds the response start until the first body chunk shows whether the request failed
    before any token; then either passes everything through or swallows it (`failed`)."""

    def __init__(self, send):
        self._send = send
        self._start: dict | None = None
        self._decided = False
        self.failed: tuple[dict, bytes] | None = None

    async def send(self, message) -> None:
        if self._decided:
            if self.failed is None:
                await self._send(message)
            return
        if message["type"] == "http.response.start":
            self._start = message
            return
        if message["type"] == "http.response.body" and self._start is not None:
            self._decided = True
            headers = {k.lower(): v for k, v in self._start.get("headers", [])}
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            chunk = message.get("body", b"")
            if first_byte_failed(self._start["status"], content_type, chunk):
                self.failed = (self._start, chunk)
                return
            await self._send(self._start)
            await self._send(message)
            return
        await self._send(message)


def _closing(send, leaving: Callable[[], bool]):
    async def send_closing(message) -> None:
        if message["type"] == "http.response.start" and leaving():
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
            message = {**message, "headers": headers + [(b"connection", b"close")]}
        await send(message)

    return send_closing


async def _forward(response: httpx.Response, send, chunks=None) -> None:
    """`response` to the client: its body as it comes, or `chunks` (a stream that may move, which closes it)."""
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()
               if k.lower() not in OWN_HEADERS]
    try:
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        async for chunk in (chunks if chunks is not None else response.aiter_raw()):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        await response.aclose()
