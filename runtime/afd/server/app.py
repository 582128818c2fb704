"""The OpenAI-compatible API of one attention rank, as a FastAPI app around the engine."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from afd.engine.engine import Engine
from afd.engine.request import InvalidRequest, RequestOutput
from afd.engine.tokenizer import chat_prompt_ids
from afd.server.formatting import chat_chunk, chat_response, completion_chunk, completion_response
from afd.server.protocol import ChatRequest, CompletionRequest, error_response


_ID_PREFIX = {"text_completion": "cmpl", "chat.completion.chunk": "chatcmpl"}


class Unavailable(Exception):
    """HTTP 503: an FFN peer is down or warm-up is not finished."""


class ModelNotFound(Exception):
    """HTTP 404: the request names a model this server does not serve."""


@dataclass
class ServerState:
    engine: Engine
    tokenizer: object
    model_name: str
    max_model_len: int
    vocab_size: int
    health: Callable[[], str | None]  # None when healthy, else the reason
    registry: CollectorRegistry


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="AFD attention rank", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        return error_response(400, f"{where + ': ' if where else ''}{first['msg']}", where or None)

    @app.exception_handler(InvalidRequest)
    async def _bad_request(_: Request, err: InvalidRequest) -> JSONResponse:
        return error_response(400, str(err), err.param)

    @app.exception_handler(ModelNotFound)
    async def _not_found(_: Request, err: ModelNotFound) -> JSONResponse:
        return error_response(404, str(err), "model")

    @app.exception_handler(Unavailable)
    async def _unavailable(_: Request, err: Unavailable) -> JSONResponse:
        return error_response(503, str(err))

    @app.get("/health")
    async def health() -> JSONResponse:
        reason = state.health()
        if reason:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "afd", "max_model_len": state.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        _check_model_and_health(state, body.model)
        prompts = _completion_prompts(state, body.prompt)
        if body.stream and len(prompts) > 1:
            raise InvalidRequest("streaming supports one prompt per request", "prompt")
        params = [body.sampling(_max_tokens(state, p, body.max_tokens), body.logprobs) for p in prompts]
        echo = [state.tokenizer.decode(p) if body.echo else "" for p in prompts]
        if body.stream:
            outputs = _Outputs(state, prompts[0], params[0])
            make = lambda rid, out, first: completion_chunk(state, rid, out, echo[0] if first else "")  # noqa: E731
            return _sse(state, outputs, make, body.include_usage, "text_completion")
        results = [await _collect(http, _Outputs(state, p, sp)) for p, sp in zip(prompts, params)]
        return JSONResponse(completion_response(state, results, echo))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: Request):
        _check_model_and_health(state, body.model)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        prompt = chat_prompt_ids(state.tokenizer, messages)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling(_max_tokens(state, prompt, max_tokens), logprobs)
        outputs = _Outputs(state, prompt, params)
        if body.stream:
            make = lambda rid, out, first: chat_chunk(state, rid, out, first)  # noqa: E731
            return _sse(state, outputs, make, body.include_usage, "chat.completion.chunk")
        return JSONResponse(chat_response(state, outputs.request.request_id, await _collect(http, outputs)))

    return app


def _check_model_and_health(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise ModelNotFound(f"the model {model!r} does not exist; this server serves {state.model_name!r}")
    reason = state.health()
    if reason:
        raise Unavailable(f"the server cannot take requests: {reason}")


def _completion_prompts(state: ServerState, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise InvalidRequest("prompt is empty", "prompt")
    ids = [state.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    for tokens in ids:
        if any(t < 0 or t >= state.vocab_size for t in tokens):
            raise InvalidRequest(f"prompt token ids must be in 0..{state.vocab_size - 1}", "prompt")
    return ids


def _max_tokens(state: ServerState, prompt: list[int], requested: int | None) -> int:
    room = state.max_model_len - len(prompt)
    if room < 1:
        raise InvalidRequest(
            f"this model's maximum context length is {state.max_model_len} tokens, and the prompt has {len(prompt)}", "prompt")
    if requested is None:
        return room
    if requested > room:
        raise InvalidRequest(
            f"this model's maximum context length is {state.max_model_len} tokens; you asked for "
            f"{len(prompt) + requested} ({len(prompt)} in the prompt, {requested} to generate)", "max_tokens")
    return requested


class _Outputs:
    """Async iterator over one request's engine outputs: (request id, output, is first)."""

    def __init__(self, state: ServerState, prompt: list[int], params):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.engine = state.engine
        self.request = state.engine.submit(prompt, params, lambda out: loop.call_soon_threadsafe(self.queue.put_nowait, out))
        self.finished = False
        self.first = True

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[str, RequestOutput, bool]:
        if self.finished:
            raise StopAsyncIteration
        output = await self.queue.get()
        self.finished = output.finished
        first, self.first = self.first, False
        return self.request.request_id, output, first

    def abort(self) -> None:
        if not self.finished:
            self.engine.abort(self.request.request_id)


async def _collect(http: Request, outputs: _Outputs) -> list[RequestOutput]:
    """Every output of a non-streaming request; aborts it if the client goes away."""
    collected: list[RequestOutput] = []
    try:
        while not outputs.finished:
            try:
                _, output, _ = await asyncio.wait_for(outputs.__anext__(), timeout=1.0)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    return collected
                continue
            if output.error:
                raise Unavailable(f"the request failed: {output.error}")
            collected.append(output)
    finally:
        outputs.abort()
    return collected


def _sse(state: ServerState, outputs: _Outputs, make_chunk, include_usage: bool, kind: str) -> StreamingResponse:
    """Server-sent events: one chunk per output, an error event if the request fails, then [DONE]."""

    async def events():
        last = None
        try:
            async for request_id, output, first in outputs:
                if output.error:
                    body = {"error": {"message": f"the request failed: {output.error}", "type": "service_unavailable", "code": 503}}
                    yield f"data: {json.dumps(body)}\n\n"
                    return
                last = output
                yield f"data: {json.dumps(make_chunk(request_id, output, first))}\n\n"
            if include_usage and last is not None:
                usage = {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                         "total_tokens": last.prompt_tokens + last.completion_tokens}
                chunk = {"id": f"{_ID_PREFIX[kind]}-{outputs.request.request_id}", "object": kind, "created": int(time.time()),
                         "model": state.model_name, "choices": [], "usage": usage}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            outputs.abort()  # a client that disconnects mid-stream frees its sequence

    return StreamingResponse(events(), media_type="text/event-stream")
