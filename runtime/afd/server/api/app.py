"""The OpenAI-compatible API of one attention rank, as a FastAPI app around the engine.

Every body is read under a size limit, parsed and checked (`protocol`, `validation`) and
tokenized on a small worker pool, never on the event loop; a request whose client goes
away is aborted in the engine at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
import uvicorn

from afd.config import ApiSettings, ProcessSettings
from afd.engine.engine import Engine
from afd.engine.request import InvalidRequest
from afd.engine.structured_output.grammars import Grammars
from afd.engine.text.tokenizer import chat_prompt_ids
from afd.server.api import choices, json_body, resume as resumes, streams, tokenize_api, validation
from afd.server.api.api_keys import ApiKeys, RequireApiKey
from afd.server.api.formatting import PromptShown, chat_response, completion_response, usage_of
from afd.server.api.http_body import BodyTimeout, BodyTooLarge, read_body
from afd.server.api.liveness import LoopWatch
from afd.server.api.protocol import (ChatRequest, CompletionRequest, ModelNotFound, Unavailable, error_response,
                                     parse_request)
from afd.server.api.answers import AnswerReading, AnswerStream
from afd.server.api.reasoning import Family, grammar_after_thinking, opens_thinking
from afd.server.api.tool_parsers import Family as ToolFamily
from afd.server.api.tools import forced_grammar
from afd.server.api.sse import StreamEvents
from afd.server.api.validation import Limits

log = logging.getLogger(__name__)
_GRAMMARS_LOCK = threading.Lock()


@dataclass
class ServerState:
    engine: Engine
    tokenizer: object
    model_name: str
    max_model_len: int
    vocab_size: int
    health: Callable[[], str | None]  # None when the engine is healthy, else the reason
    registry: CollectorRegistry
    limits: Limits = field(default_factory=Limits)
    loop_watch: LoopWatch = field(default_factory=LoopWatch)
    # Parsing and tokenizing run here: off the event loop, and at most two at a time.
    workers: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="api-cpu"))
    # The /metrics body when the series live elsewhere (the API process shows the engine core's); None: `registry`'s.
    exposition: Callable[[], bytes] | None = None
    grammars: Grammars | None = None  # structured-output grammars checked here when the engine is in another process
    resume_key: bytes = field(default=b"", repr=False)  # the group secret: signs streams moved here (`resume`)
    api_keys: ApiKeys = field(default_factory=ApiKeys)  # `api_key`: what every route but the probes asks for
    reasoning: Family | None = None  # `reasoning_parser`: how the thinking is split from chat answers; None: it is not
    reasoning_content: bool = False  # the thinking also as `reasoning_content` (older clients)
    tool_parser: ToolFamily | None = None  # `tool_call_parser`: reads `tool_choice: auto` calls; None: not read

    def problem(self) -> str | None:
        """Why this rank cannot serve (engine, FFN link or event loop), or None."""
        return self.health() or self.loop_watch.problem()


def http_server(app, api: ApiSettings, process: ProcessSettings):
    """uvicorn serving `app` on `api`'s address; on SIGTERM no new requests, and in-flight ones finish within
    `process.shutdown_grace_s`."""
    return uvicorn.Server(uvicorn.Config(
        app, host=api.http_host, port=api.http_port, log_level="warning", timeout_keep_alive=30,
        timeout_graceful_shutdown=int(process.shutdown_grace_s),
    ))


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        watch = asyncio.create_task(state.loop_watch.run())  # the probes see a stalled or stopped loop
        yield
        watch.cancel()

    app = FastAPI(title="AFD attention rank", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(RequireApiKey, keys=state.api_keys)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        reason = state.problem()
        if reason:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await _off_loop(state, state.exposition) if state.exposition else generate_latest(state.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "afd", "max_model_len": state.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def _tokens(http: Request, convert, bound: int) -> JSONResponse:
        """/tokenize and /detokenize: `convert` the body off the loop (`bound`: the most tokens, or the vocabulary)."""
        body = await _json_body(state, http)
        model, answer = await _off_loop(state, convert, body, state.tokenizer, state.limits, bound)
        _check_model(state, model)
        return JSONResponse(answer)

    @app.post("/tokenize")
    async def tokenize(http: Request) -> JSONResponse:
        return await _tokens(http, tokenize_api.tokenize, state.max_model_len)

    @app.post("/detokenize")
    async def detokenize(http: Request) -> JSONResponse:
        return await _tokens(http, tokenize_api.detokenize, state.vocab_size)

    @app.post("/v1/completions")
    async def completions(http: Request):
        body = await _off_loop(state, _prepare_completion, state, await _json_body(state, http))
        request, prompts, params, echo = body
        resume = _resume_of(state, http, request.stream, request.n)
        if request.stream:
            shown = PromptShown(prompts, request.echo_logprobs, request.prompt_logprobs)
            candidates = choices.candidate_params(params[0], request.n, None)
            streamed = streams.StreamedChoices(state.engine, prompts[0], candidates, resume)
            events = StreamEvents(state, resume.request_id("text_completion") if resume else streamed.request_id,
                                  "text_completion", None if resume else shown)
            make = lambda index, out, first: events.completion(out, echo[0] if first else "", index, first)  # noqa: E731
            return streams.sse_response(streamed, events, make, request.include_usage, _wants_ids(http))
        count = max(request.n, request.best_of or 1)  # engine requests per prompt
        candidates = [c for sampling in params for c in choices.candidate_params(sampling, request.n, request.best_of)]
        groups = [g for g in [streams.group_of(count) for _ in prompts] for _ in range(count)]
        submitted = streams.submit_all(state.engine, [p for p in prompts for _ in range(count)], candidates, groups)
        results = await streams.complete(http, submitted)
        if results is None:
            return Response(status_code=499)
        picked = [choice for i in range(len(prompts)) for choice in choices.pick_best(
            results[i * count: (i + 1) * count], request.n, request.logprobs is not None)]
        per_choice = lambda values: [v for v in values for _ in range(request.n)]  # noqa: E731
        shown = PromptShown(per_choice(prompts), request.echo_logprobs, request.prompt_logprobs)
        usage = usage_of(sum(map(len, prompts)), choices.completion_tokens(results), choices.cached_tokens(results, count))
        return JSONResponse(completion_response(state, picked, per_choice(echo), shown, usage))

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        request, prompt, params, reading = await _off_loop(state, _prepare_chat, state, await _json_body(state, http))
        resume = _resume_of(state, http, request.stream, request.n)
        if request.stream:
            candidates = choices.candidate_params(params, request.n, None)
            streamed = streams.StreamedChoices(state.engine, prompt, candidates, resume)
            events = StreamEvents(state, resume.request_id("chat.completion.chunk") if resume else streamed.request_id,
                                  "chat.completion.chunk", PromptShown([prompt], None, request.prompt_logprobs),
                                  _answer_streams(state, reading, resume))
            make = lambda index, out, first: events.chat(out, first, index, not resume)  # noqa: E731
            return streams.sse_response(streamed, events, make, request.include_usage, _wants_ids(http))
        submitted = streams.submit_all(state.engine, [prompt] * request.n, choices.candidate_params(params, request.n, None),
                                       [streams.group_of(request.n)] * request.n)
        results = await streams.complete(http, submitted)
        if results is None:
            return Response(status_code=499)
        usage = usage_of(len(prompt), choices.completion_tokens(results), choices.cached_tokens(results, request.n))
        return JSONResponse(chat_response(state, submitted[0].request.request_id, results, request.prompt_logprobs,
                                          usage, reading))

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        return error_response(400, str(first["msg"]))

    @app.exception_handler(InvalidRequest)
    async def _bad_request(_: Request, err: InvalidRequest) -> JSONResponse:
        return error_response(400, str(err), err.param)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_: Request, err: BodyTooLarge) -> JSONResponse:
        return error_response(413, str(err))

    @app.exception_handler(BodyTimeout)
    async def _too_slow(_: Request, err: BodyTimeout) -> JSONResponse:
        return error_response(408, str(err))

    @app.exception_handler(ModelNotFound)
    async def _not_found(_: Request, err: ModelNotFound) -> JSONResponse:
        return error_response(404, str(err), "model")

    @app.exception_handler(Unavailable)
    async def _unavailable(_: Request, err: Unavailable) -> JSONResponse:
        return error_response(503, str(err))

    @app.exception_handler(Exception)
    async def _bug(_: Request, err: Exception) -> JSONResponse:
        log.exception("request failed")
        return error_response(500, f"internal error: {type(err).__name__}")


async def _off_loop(state: ServerState, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(state.workers, fn, *args)


async def _json_body(state: ServerState, http: Request) -> dict:
    raw = await read_body(http, state.limits.max_request_bytes)
    return await _off_loop(state, json_body.parse_json_body, raw, state.limits.max_json_depth)


def _prepare_completion(state: ServerState, body: dict):
    """(request, prompt ids, sampling params, echo texts), or InvalidRequest. Runs on a worker."""
    request = parse_request(CompletionRequest, body)
    _check_model_and_health(state, request.model)
    prompts = validation.completion_prompts(request.prompt, state.limits, state.vocab_size, state.max_model_len)
    if request.stream and len(prompts) > 1:
        raise InvalidRequest("streaming supports one prompt per request", "prompt")
    if len(prompts) * max(request.n, request.best_of or 1) > state.limits.max_prompts:
        raise InvalidRequest(f"{len(prompts)} prompts x {max(request.n, request.best_of or 1)} choices exceed "
                             f"{state.limits.max_prompts} sequences per request (AFD_MAX_PROMPTS)",
                             "best_of" if (request.best_of or 1) > request.n else "n")
    ids = [state.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    grammar = _grammar(state, request)
    params = [request.sampling(_max_tokens(state, p, request.max_tokens), request.logprobs, state.vocab_size, state.limits,
                               state.tokenizer, request.engine_prompt_logprobs, grammar)
              for p in ids]
    echo = [state.tokenizer.decode(p) if request.echo else "" for p in ids]
    return request, ids, params, echo


def _prepare_chat(state: ServerState, body: dict):
    """(request, prompt ids, sampling params, how its answers are read), or InvalidRequest. Runs on a worker."""
    request = parse_request(ChatRequest, body)
    _check_model_and_health(state, request.model)
    if request.n > state.limits.max_prompts:
        raise InvalidRequest(f"n={request.n}: at most {state.limits.max_prompts} choices (AFD_MAX_PROMPTS)", "n")
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs=true", "top_logprobs")
    messages = validation.chat_messages([m.model_dump(exclude_none=True) for m in request.messages], state.limits)
    template_kwargs = validation.template_kwargs(request.chat_template_kwargs)
    tools = request.tool_request()
    prompt = chat_prompt_ids(state.tokenizer, messages, template_kwargs=template_kwargs,
                             tools=request.tools if tools is not None else None)
    # the prompt's last tokens say whether the template opened the thinking (`reasoning.opens_thinking`)
    thinking = bool(state.reasoning) and opens_thinking(state.reasoning, state.tokenizer.decode(prompt[-8:]),
                                                        template_kwargs)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    reading = AnswerReading(state.reasoning, thinking, tools if tools is not None and tools.choice != "none" else None,
                            state.tool_parser)
    params = request.sampling(_max_tokens(state, prompt, max_tokens), logprobs, state.vocab_size, state.limits,
                              state.tokenizer, grammar=_grammar(state, request, thinking, reading))
    if reading.reads_calls and not reading.tools.forced:  # the markup may be special tokens (Kimi-K2's): keep them
        params = dataclasses.replace(params, skip_special_tokens=False)
    return request, prompt, params, reading


def _answer_streams(state: ServerState, reading: AnswerReading, resume: resumes.Resume | None):
    """With a reasoning or tool-call reading: what makes choice `index`'s `AnswerStream`; a moved stream's is first
    fed the text its client already saw (only its state is kept: what was shown, what is held back)."""
    if reading.thinking_family is None and not reading.reads_calls:
        return None
    seen = [state.tokenizer.decode(list(ids)) for ids in resume.choices] if resume is not None else None

    def answer_of(index: int) -> AnswerStream:
        answer = AnswerStream(reading)
        if seen:
            answer.feed(seen[index])
        return answer
    return answer_of


def _grammar(state: ServerState, request, thinking: bool = False, reading: AnswerReading | None = None) -> str | None:
    """The request's structured-output grammar, compiled (and cached) here on the worker, or None; a forced tool
    choice's instead (`tools`); with a reasoning parser, a chat answer's grammar applies after its thinking
    (`thinking`: the answer starts inside it)."""
    if reading is not None and reading.tools is not None and reading.tools.forced:
        found = forced_grammar(reading.tools), "tools"
    else:
        found = request.grammar()
    if found is None:
        return None
    grammar, field = found
    if state.reasoning is not None and isinstance(request, ChatRequest):
        grammar = grammar_after_thinking(grammar, state.reasoning, thinking)
    grammars = getattr(state.engine, "grammars", None)
    if grammars is None:  # an API process: checked here on its own cache (the engine core compiles it again)
        with _GRAMMARS_LOCK:
            if state.grammars is None:
                state.grammars = Grammars(state.tokenizer, state.vocab_size, ())
        grammars = state.grammars
    grammars.check(grammar, field)
    return grammar


def _check_model(state: ServerState, model: str | None) -> None:
    """404 unless `model` is the served one (None: not named, as /tokenize allows)."""
    if model is not None and model != state.model_name:
        raise ModelNotFound(f"the model {json_body.short(model)!r} does not exist; this server serves {state.model_name!r}")


def _check_model_and_health(state: ServerState, model: str) -> None:
    _check_model(state, model)
    reason = state.problem()
    if reason:
        raise Unavailable(f"the server cannot take requests: {reason}")


def _resume_of(state: ServerState, http: Request, stream: bool, n: int = 1) -> resumes.Resume | None:
    """The stream a relay moves here from a lost rank (`afd.server.api.resume`), or None; InvalidRequest if unfit."""
    resume = resumes.verify(state.resume_key, http.headers.get(resumes.RESUME_HEADER), state.vocab_size)
    if resume is not None and not stream:
        raise InvalidRequest(f"{resumes.RESUME_HEADER} continues streams only", resumes.RESUME_HEADER)
    if resume is not None and len(resume.choices) != n:
        raise InvalidRequest(f"{resumes.RESUME_HEADER} carries {len(resume.choices)} choices, the request asks n={n}",
                             resumes.RESUME_HEADER)
    return resume


def _wants_ids(http: Request) -> bool:
    """A relay asks for each event's token ids (SSE comments), to move the stream should this rank die."""
    return http.headers.get(resumes.IDS_HEADER) == "1"


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
