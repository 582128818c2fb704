"""Moving a stream (issue 38): the signed resume header, the relay's reading of a stream, a rank continuing a
stream it did not start, and the failover relay moving a relayed stream whose rank dies."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from afd.engine.request import InvalidRequest
from afd.server.api.resume import IDS_HEADER, RESUME_HEADER, Resume, StreamReader, sign, verify
from afd.server.front.failover import Failover, FailoverSettings

KEY = b"group-secret"


def _mac_of(payload: str) -> str:
    import hashlib
    import hmac

    return hmac.new(KEY, payload.encode(), hashlib.sha256).hexdigest()


def test_a_signed_resume_verifies_and_anything_else_is_refused_by_name():
    resume = Resume("chatcmpl-abc", (5, 6, 7))
    assert verify(KEY, sign(KEY, resume), 100) == resume
    assert verify(KEY, None, 100) is None
    with pytest.raises(InvalidRequest, match="not signed"):
        verify(KEY, sign(b"another", resume), 100)
    with pytest.raises(InvalidRequest, match="no group secret"):
        verify(b"", sign(KEY, resume), 100)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        verify(KEY, sign(KEY, resume), 7)
    with pytest.raises(InvalidRequest, match="1..2048 token ids"):
        verify(KEY, sign(KEY, Resume("cmpl-x", ())), 100)
    with pytest.raises(InvalidRequest, match="1..2048 token ids"):
        verify(KEY, sign(KEY, Resume("cmpl x\r\n", (1,))), 100)
    with pytest.raises(InvalidRequest, match="not a valid resume"):
        verify(KEY, "cmpl-x.@@@." + _mac_of("cmpl-x.@@@"), 100)
    with pytest.raises(InvalidRequest, match="not a text_completion id"):
        resume.request_id("text_completion")
    assert resume.request_id("chat.completion.chunk") == "abc"
    choices = Resume("cmpl-n", (5, 6), ((), (7,)), (0,))  # n = 3: choice 0 finished, choice 1 not started
    assert verify(KEY, sign(KEY, choices), 100) == choices and choices.choices == ((5, 6), (), (7,))
    with pytest.raises(InvalidRequest, match="a choice to continue"):
        verify(KEY, sign(KEY, Resume("cmpl-n", (5,), ((6,),), (0, 1))), 100)


def test_the_reader_passes_whole_events_strips_id_comments_and_knows_when_a_stream_is_over():
    reader = StreamReader()
    first = b': afd-ids 1,2\ndata: {"id": "cmpl-9", "choices": []}\n\n: afd-ids 3\ndata: {"id": "cm'
    assert reader.feed(first) == b'data: {"id": "cmpl-9", "choices": []}\n\n'
    assert reader.feed(b'pl-9"}\n\n') == b'data: {"id": "cmpl-9"}\n\n'
    assert reader.token_ids == [1, 2, 3] and reader.resume() == Resume("cmpl-9", (1, 2, 3)) and reader.resumable
    reader.feed(b"data: [DONE]\n\n")
    assert not reader.resumable
    failed = StreamReader()
    failed.feed(b'data: {"error": {"message": "x"}}\n\n')
    assert not failed.resumable and failed.resume() is None
    silent = StreamReader()  # a rank that does not say its token ids (vLLM's): nothing to continue from
    assert silent.resumable and silent.resume() is None  # nothing went out: sent again whole
    silent.feed(b'data: {"id": "cmpl-2", "choices": [{"text": "a", "finish_reason": null}]}\n\n')
    assert not silent.resumable
    ended = StreamReader()
    ended.feed(b': afd-ids 4\ndata: {"id": "cmpl-3", "choices": [{"text": "a", "finish_reason": "length"}]}\n\n')
    assert ended.finished and not ended.resumable


def _events(stream_id: str, tokens: list[tuple[int, str]], done: bool) -> list[bytes]:
    out = [f': afd-ids {t}\ndata: {json.dumps({"id": stream_id, "choices": [{"index": 0, "text": s}]})}\n\n'.encode()
           for t, s in tokens]
    return out + ([b"data: [DONE]\n\n"] if done else [])


class _CutStream(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes], cut: bool):
        self.chunks, self.cut = chunks, cut

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        if self.cut:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


class _Service(httpx.AsyncBaseTransport):
    """The client Service: the first rank it picks dies after two tokens; the next continues from the resume."""

    def __init__(self):
        self.seen: list[httpx.Headers] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request.headers)
        headers = {"content-type": "text/event-stream"}
        if len(self.seen) == 1:
            return httpx.Response(200, headers=headers, stream=_CutStream(_events("cmpl-1", [(7, "a"), (8, "b")], False)
                                                                         + [b': afd-ids 9\ndata: {"id"'], True))
        resume = verify(KEY, request.headers.get(RESUME_HEADER), 100)
        assert resume == Resume("cmpl-1", (7, 8))
        return httpx.Response(200, headers=headers, stream=_CutStream(_events("cmpl-1", [(9, "c"), (10, "d")], True), False))


def _rank_that_cannot_serve():
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": {"message": "ffn lost"}}'})
    return app


def _relay(key: bytes) -> tuple[Failover, _Service]:
    service = _Service()
    settings = FailoverSettings(url="http://service", attempts=3, backoff_s=0.01, resume_key=key)
    return Failover(_rank_that_cannot_serve(), lambda: False, settings, httpx.AsyncClient(transport=service)), service


def _post(app) -> str:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rank") as client:
            response = await client.post("/v1/completions", json={"prompt": "hi", "stream": True},
                                         headers={RESUME_HEADER: "forged.0"})
            return response.text
    return asyncio.run(go())


def test_a_relayed_stream_whose_rank_dies_goes_on_from_another_rank_with_nothing_twice():
    relay, service = _relay(KEY)
    body = _post(relay)
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in body.split("\n") if line.startswith("data: {")]
    assert texts == ["a", "b", "c", "d"] and body.endswith("data: [DONE]\n\n") and "afd-ids" not in body
    assert relay.moves == 1 and all(h[IDS_HEADER] == "1" for h in service.seen)
    assert RESUME_HEADER not in service.seen[0]  # the client's own x-afd-* headers never pass


def test_without_the_group_secret_a_cut_relayed_stream_stays_cut():
    relay, service = _relay(b"")
    with pytest.raises(httpx.RemoteProtocolError):  # the cut reaches the client, as before
        _post(relay)
    assert len(service.seen) == 1 and relay.moves == 0


def _stream(server, headers: dict, body: dict) -> tuple[int, list[dict], list[list[int]], str]:
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    chunks, ids = [], []
    for event in response.text.split("\n\n"):
        lines = event.split("\n")
        ids += [[int(t) for t in line[len(": afd-ids "):].split(",")] for line in lines if line.startswith(": afd-ids ")]
        chunks += [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return response.status_code, chunks, ids, response.text


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 77}], ids=["greedy", "seeded"])
def test_a_rank_continues_a_moved_stream_under_its_id_as_the_undisturbed_one_goes_on(server, sampling):
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **sampling}
    status, full, ids, _ = _stream(server, {IDS_HEADER: "1"}, body)
    assert status == 200 and len(ids) == 12
    carried = [t for per_event in ids[:5] for t in per_event]
    server.state.resume_key = KEY
    try:
        header = sign(KEY, Resume(full[0]["id"], tuple(carried)))
        status, rest, rest_ids, _ = _stream(server, {RESUME_HEADER: header}, body)
    finally:
        server.state.resume_key = b""
    assert status == 200 and rest_ids == []  # no ids asked for this time
    text = lambda chunks: "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])  # noqa: E731
    assert text(full[:5]) + text(rest) == text(full)
    assert {c["id"] for c in rest} == {full[0]["id"]} and all("role" not in c["choices"][0]["delta"] for c in rest[:-1])
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: what each found in the cache
    assert [rest[-1]["usage"][k] for k in counts] == [full[-1]["usage"][k] for k in counts]


def test_an_outside_client_cannot_resume_a_stream(server):
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    status, _, _, text = _stream(server, {RESUME_HEADER: sign(KEY, Resume("chatcmpl-x", (1, 2)))}, body)
    assert status == 400 and RESUME_HEADER in text and "no group secret" in text
    server.state.resume_key = KEY
    try:
        forged = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30,
                            headers={RESUME_HEADER: sign(b"guess", Resume("chatcmpl-x", (1, 2)))})
        not_streamed = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": False}, timeout=30,
                                  headers={RESUME_HEADER: sign(KEY, Resume("chatcmpl-x", (1, 2)))})
    finally:
        server.state.resume_key = b""
    assert forged.status_code == 400 and "not signed" in forged.json()["error"]["message"]
    assert not_streamed.status_code == 400 and "streams only" in not_streamed.json()["error"]["message"]
    longest = sign(KEY, Resume("chatcmpl-x", tuple(i % 100 for i in range(2048))))  # the most a resume carries passes the HTTP server
    server.state.resume_key = KEY
    try:
        at_most = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": False}, timeout=30,
                             headers={RESUME_HEADER: longest})
    finally:
        server.state.resume_key = b""
    assert at_most.status_code == 400 and "streams only" in at_most.json()["error"]["message"]


def _collect(response: httpx.Response, reopen) -> bytes:
    from afd.server.front.splice import spliced

    async def release(_):
        pass

    async def go():
        return b"".join([chunk async for chunk in spliced(response, reopen, release)])
    return asyncio.run(go())


def test_a_stream_cut_after_its_last_token_only_gets_its_end_and_one_no_rank_takes_gets_an_error_event():
    async def never(_):
        raise AssertionError("nothing to move")

    last = _events("cmpl-1", [(7, "a")], False)[0].replace(b'"text": "a"}', b'"text": "a", "finish_reason": "length"}')
    ended = _collect(httpx.Response(200, stream=_CutStream([last], True)), never)
    assert ended.endswith(b"data: [DONE]\n\n") and b"error" not in ended

    async def nobody(resume):
        assert resume == Resume("cmpl-1", (7,))
        return None

    cut = _collect(httpx.Response(200, stream=_CutStream(_events("cmpl-1", [(7, "a")], False), True)), nobody)
    assert b'"error"' in cut and cut.endswith(b"data: [DONE]\n\n")


def test_a_cut_stream_that_cannot_move_ends_with_an_error_event_not_silence():
    async def never(_):
        raise AssertionError("no token ids: nothing to move")

    chunk = b'data: {"id": "cmpl-5", "choices": [{"text": "a", "finish_reason": null}]}\n\n'
    cut = _collect(httpx.Response(200, stream=_CutStream([chunk], True)), never)
    assert cut.startswith(chunk) and b'"error"' in cut and cut.endswith(b"data: [DONE]\n\n")


def _choice_events(stream_id: str, choices: list[tuple[int, int, str, str | None]], ids: bool = True) -> list[bytes]:
    """A stream of n = 2 choices as a rank gives it to a relay: n said once, each event's (token id, text) under its
    index (`ids`: with the ids comments)."""
    out = []
    for index, token, text, reason in choices:
        chunk = {"id": stream_id, "choices": [{"index": index, "text": text, "finish_reason": reason}]}
        out.append((f": afd-ids {index}:{token}\n" if ids else "").encode() + f"data: {json.dumps(chunk)}\n\n".encode())
    return [b": afd-choices 2\n" + out[0], *out[1:]]


def test_a_cut_stream_of_n_choices_moves_each_unfinished_choice_from_its_own_tokens():
    one_done = _choice_events("cmpl-6", [(0, 1, "a", None), (1, 2, "b", None), (0, 3, "c", "length")])

    async def reopen(resume):
        assert resume == Resume("cmpl-6", (1, 3), ((2,),), (0,))  # choice 0 is over: only choice 1 goes on
        return httpx.Response(200, stream=_CutStream(_choice_events("cmpl-6", [(1, 4, "d", "length")])
                                                     + [b"data: [DONE]\n\n"], False))

    moved = _collect(httpx.Response(200, stream=_CutStream(one_done, True)), reopen)
    texts = [(c["index"], c["text"]) for line in moved.split(b"\n") if line.startswith(b"data: {")
             for c in json.loads(line[6:])["choices"]]
    assert texts == [(0, "a"), (1, "b"), (0, "c"), (1, "d")] and b"afd-" not in moved and b"error" not in moved

    async def never(_):
        raise AssertionError("a rank that says no ids: not moved")

    silent = _choice_events("cmpl-7", [(0, 1, "a", None), (1, 2, "b", None)], ids=False)
    cut = _collect(httpx.Response(200, stream=_CutStream(silent, True)), never)
    assert b'"error"' in cut and cut.endswith(b"data: [DONE]\n\n")
    both_done = _choice_events("cmpl-6", [(0, 1, "a", "length"), (1, 2, "b", "length")])
    ended = _collect(httpx.Response(200, stream=_CutStream(both_done, True)), never)
    assert b'"error"' not in ended and ended.endswith(b"data: [DONE]\n\n")


def test_a_moved_echo_stream_shows_the_prompt_once(server):
    body = {"model": server.model, "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 1, "prompt_logprobs": 1, "stream": True}

    def stream(headers):
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
        events = [e.split("\n") for e in response.text.split("\n\n")]
        ids = [[int(t) for t in line[len(": afd-ids "):].split(",")] for e in events for line in e
               if line.startswith(": afd-ids ")]
        return [json.loads(line[6:])["choices"][0] for e in events for line in e if line.startswith("data: {")], ids

    full, ids = stream({IDS_HEADER: "1"})
    server.state.resume_key = KEY
    try:
        rest, _ = stream({RESUME_HEADER: sign(KEY, Resume("cmpl-" + "x", tuple(t for i in ids[:2] for t in i)))})
    finally:
        server.state.resume_key = b""
    assert "prompt_logprobs" in full[0] and all("prompt_logprobs" not in c for c in rest)
    assert "".join(c["text"] for c in full[:2]) + "".join(c["text"] for c in rest) == "".join(c["text"] for c in full)
    assert [t for c in rest for t in c["logprobs"]["tokens"]] == [t for c in full[2:] for t in c["logprobs"]["tokens"]]


def test_a_moved_stream_of_tool_calls_goes_on_without_sending_a_call_twice(server):
    """Issue 52: a named tool choice's stream moved after 5 tokens: the new rank reads its answer from what the client
    saw, so the call's id and name are not sent again and its arguments go on where they stopped (the grammar too)."""
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "tag": {"enum": ["alpha", "beta"]}},
        "required": ["tag", "n"], "additionalProperties": False}}}]
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "stream": True,
            "temperature": 0, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "pick"}}}
    status, full, ids, _ = _stream(server, {IDS_HEADER: "1"}, body)
    assert status == 200 and len(ids) > 5
    server.state.resume_key = KEY
    try:
        header = sign(KEY, Resume(full[0]["id"], tuple(t for per_event in ids[:5] for t in per_event)))
        status, rest, _, _ = _stream(server, {RESUME_HEADER: header}, body)
    finally:
        server.state.resume_key = b""
    calls = lambda chunks: [call for c in chunks if c["choices"] for call in c["choices"][0]["delta"].get("tool_calls", [])]  # noqa: E731
    arguments = lambda found: "".join(call["function"]["arguments"] for call in found)  # noqa: E731
    assert status == 200 and not any("id" in call for call in calls(rest))
    assert arguments(calls(full[:5])) + arguments(calls(rest)) == arguments(calls(full))
    json.loads(arguments(calls(full)))
    assert rest[-1]["choices"][0]["finish_reason"] == full[-1]["choices"][0]["finish_reason"] == "stop"
