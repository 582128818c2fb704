"""Failover: a rank that answers 503 before its first token sends the request on to the Service."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from afd.server.front.failover import Failover, FailoverSettings, first_byte_failed


def _rank(name: str, answer: str, seen: list | None = None) -> FastAPI:
    """A stand-in rank: answers `ok` (a stream of 3 tokens or JSON), `503`, `400` or `stream-error`."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if seen is not None:
            seen.append((dict(request.headers), body))
        if answer == "503":
            return JSONResponse({"error": {"message": f"{name} cannot serve", "code": 503}}, status_code=503)
        if answer == "400":
            return JSONResponse({"error": {"message": "bad prompt", "code": 400}}, status_code=400)
        if answer == "stream-error" or body.get("stream"):
            async def events():
                if answer == "stream-error":
                    yield 'data: {"error": {"message": "the request failed", "code": 503}}\n\n'
                    return
                for token in ("a", "b", "c"):
                    yield f"data: {json.dumps({'from': name, 'text': token})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"from": name, "prompt": body["prompt"]})

    return app


def _call(front, body, headers=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://rank") as client:
            return await client.post("/v1/completions", json=body, headers=headers or {})
    return asyncio.run(go())


def _failover(rank: FastAPI, other: FastAPI | None, leaving=lambda: False, attempts=3) -> Failover:
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=other)) if other is not None else None
    settings = FailoverSettings(url="http://service" if other is not None else "", attempts=attempts, backoff_s=0.01)
    return Failover(rank, leaving, settings, client)


def test_a_503_before_any_token_is_answered_by_another_group():
    seen: list = []
    front = _failover(_rank("a", "503"), _rank("b", "ok", seen))
    response = _call(front, {"prompt": "hi"})
    assert response.status_code == 200 and response.json() == {"from": "b", "prompt": "hi"}
    assert seen[0][0]["x-afd-failover"] == "1" and seen[0][1] == {"prompt": "hi"}
    assert front.relayed == 1


def test_a_stream_whose_first_event_is_an_error_goes_on_and_streams_from_the_other_group():
    front = _failover(_rank("a", "stream-error"), _rank("b", "ok"))
    response = _call(front, {"prompt": "hi", "stream": True})
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert [json.loads(e) for e in events[:-1]] == [{"from": "b", "text": t} for t in "abc"]


def test_a_healthy_stream_passes_through_untouched():
    front = _failover(_rank("a", "ok"), _rank("b", "ok"))
    response = _call(front, {"prompt": "hi", "stream": True})
    assert [json.loads(line[6:])["from"] for line in response.text.splitlines() if line.startswith("data: {")] == ["a"] * 3
    assert front.relayed == 0


def test_client_errors_are_answered_here_not_sent_on():
    seen: list = []
    front = _failover(_rank("a", "400"), _rank("b", "ok", seen))
    assert _call(front, {"prompt": "hi"}).status_code == 400 and not seen


def test_a_relayed_request_is_never_relayed_again():
    seen: list = []
    front = _failover(_rank("a", "503"), _rank("b", "ok", seen))
    response = _call(front, {"prompt": "hi"}, headers={"x-afd-failover": "1"})
    assert response.status_code == 503 and not seen


def test_when_no_group_can_take_it_the_client_gets_this_ranks_503_after_the_retries():
    seen: list = []
    front = _failover(_rank("a", "503"), _rank("b", "503", seen), attempts=4)
    response = _call(front, {"prompt": "hi"})
    assert response.status_code == 503 and response.json()["error"]["message"] == "a cannot serve"
    assert len(seen) == 4


def test_without_a_failover_url_the_503_reaches_the_client():
    front = _failover(_rank("a", "503"), None)
    assert _call(front, {"prompt": "hi"}).status_code == 503


@pytest.mark.parametrize("leaving", [True, False])
def test_a_rank_that_is_not_ready_closes_each_connection_after_its_answer(leaving):
    front = _failover(_rank("a", "ok"), None, leaving=lambda: leaving)
    response = _call(front, {"prompt": "hi"})
    assert response.status_code == 200
    assert (response.headers.get("connection") == "close") is leaving


@pytest.mark.parametrize("status, content_type, first, failed", [
    (503, "application/json", b'{"error": {}}', True),
    (200, "text/event-stream", b'data: {"error": {"message": "x"}}\n\n', True),
    (200, "text/event-stream", b'data: {"id": "cmpl-1", "choices": []}\n\n', False),
    (200, "application/json", b'{"error": 1}', False),
    (400, "application/json", b'{"error": {}}', False),
])
def test_first_byte_failed(status, content_type, first, failed):
    assert first_byte_failed(status, content_type, first) is failed
