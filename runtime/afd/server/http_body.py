"""Request plumbing shared by a rank's API and the front door: bounded bodies, gone clients."""

from __future__ import annotations

from fastapi import Request


class BodyTooLarge(Exception):
    """HTTP 413: the body is over the configured limit."""

    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than the {limit}-byte limit (AFD_MAX_REQUEST_BYTES)")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (413) as soon as it is known to pass `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)  # refused before a byte is read
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (call after the body is read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
