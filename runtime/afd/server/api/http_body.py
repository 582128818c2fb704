"""Request plumbing shared by a rank's API, its failover and the front door: bounded bodies,
gone clients, the headers a relay must not copy."""

from __future__ import annotations

import asyncio

from fastapi import Request

BODY_TIMEOUT_S = 60.0  # a client trickling its body (slowloris) holds a connection no longer than this
HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "host"})  # per connection: never relayed
OWN_HEADERS = HOP_HEADERS | {"date", "server"}  # a relay's own uvicorn writes these on the way back


class BodyTooLarge(Exception):
    """HTTP 413: the body is over the configured limit."""

    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than the {limit}-byte limit (AFD_MAX_REQUEST_BYTES)")


class BodyTimeout(Exception):
    """HTTP 408: the body did not arrive in time."""

    def __init__(self, seconds: float):
        super().__init__(f"the request body did not arrive within {seconds:.0f} s")


async def read_body(request: Request, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The whole body, refused (413) as soon as it is known to pass `limit` bytes, or (408) when slow."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)  # refused before a byte is read
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout(timeout_s) from None
    return b"".join(chunks)


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (call after the body is read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
