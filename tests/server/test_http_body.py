"""Bodies are read under a size limit and a time limit; a client that leaves is noticed."""

import asyncio

import pytest
from starlette.requests import Request

from afd.server.api.http_body import BodyTimeout, BodyTooLarge, client_gone, read_body


def request(messages, headers=()):
    queue = list(messages)

    async def receive():
        if not queue:
            await asyncio.sleep(3600)  # a client that never sends the rest
        item = queue.pop(0)
        if isinstance(item, float):
            await asyncio.sleep(item)
            return await receive()
        return item

    return Request({"type": "http", "method": "POST", "headers": list(headers)}, receive)


def chunk(data: bytes, more: bool) -> dict:
    return {"type": "http.request", "body": data, "more_body": more}


def test_a_body_within_the_limit_is_read_whole():
    body = asyncio.run(read_body(request([chunk(b"ab", True), chunk(b"cd", False)]), limit=4))
    assert body == b"abcd"


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    never_read = request([], headers=[(b"content-length", b"5000000000")])
    with pytest.raises(BodyTooLarge, match="AFD_MAX_REQUEST_BYTES"):
        asyncio.run(asyncio.wait_for(read_body(never_read, limit=10), 1))


def test_a_chunked_body_over_the_limit_is_refused_as_it_arrives():
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(request([chunk(b"x" * 8, True), chunk(b"x" * 8, True)]), limit=10))


def test_a_trickled_body_times_out():
    with pytest.raises(BodyTimeout, match="did not arrive"):
        asyncio.run(read_body(request([chunk(b"x", True)]), limit=10, timeout_s=0.2))


def test_client_gone_returns_on_disconnect():
    asyncio.run(asyncio.wait_for(client_gone(request([0.05, {"type": "http.disconnect"}])), 2))
