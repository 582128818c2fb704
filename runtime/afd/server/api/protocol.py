"""OpenAI request bodies (what we accept, typed) and error bodies (what clients parse).

The models check types (strict: no "3" for 3, no NaN or Infinity); `validation` checks
ranges, strings and counts, and refuses undeclared fields that ask for something this
server does not do.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from afd.engine.request import InvalidRequest, SamplingParams
from afd.server.api import json_body, structured, validation
from afd.server.api.tools import Tools, tools_of
from afd.server.api.validation import Limits


class Unavailable(Exception):
    """HTTP 503: an FFN peer is down, warm-up is not finished, or the request failed in the engine."""


class ModelNotFound(Exception):
    """HTTP 404: the request names a model this server does not serve."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    # Undeclared fields land in `model_extra`, where `validation.refuse_unsupported` judges them.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache blocks
    # structured outputs (`afd.server.api.structured`): OpenAI's, and vLLM's older and current forms
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    stream_options: StreamOptions | None = None

    def check(self) -> None:
        """Ranges and unsupported fields; 400 naming the field."""
        validation.check_bounds(self.__dict__)
        validation.refuse_unsupported(self.model_extra or {})
        if self.cache_salt is not None and not self.cache_salt:
            raise InvalidRequest("cache_salt must be a non-empty string when set", "cache_salt")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream=true", "stream_options")

    def grammar(self) -> tuple[str, str] | None:
        """(llguidance grammar, the field it came from) of the structured-output fields, or None."""
        return structured.grammar_of(self.__dict__)

    def sampling(self, max_tokens: int, logprobs: int | None, vocab_size: int, limits: Limits,
                 tokenizer=None, prompt_logprobs: int | None = None, grammar: str | None = None) -> SamplingParams:
        """The engine's parameters; `tokenizer` turns `bad_words` into token ids (required when they are set);
        `prompt_logprobs`: alternatives per prompt token (default the request's own field); `grammar`: the
        compiled-once structured-output grammar."""
        prompt_logprobs = self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
        if self.min_tokens and self.min_tokens > max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
        banned, sequences = validation.bad_words(self.bad_words, tokenizer, limits)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else min(self.top_k, vocab_size),
            seed=self.seed,
            stop=validation.stop_strings(self.stop, limits),
            stop_token_ids=validation.stop_token_ids(self.stop_token_ids, vocab_size, limits),
            ignore_eos=self.ignore_eos,
            logprobs=None if logprobs is None else min(logprobs, vocab_size),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens or 0,
            logit_bias=validation.logit_bias(self.logit_bias, vocab_size, limits),
            allowed_token_ids=validation.allowed_token_ids(self.allowed_token_ids, vocab_size, limits),
            banned_token_ids=banned, banned_sequences=sequences,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            prompt_logprobs=None if prompt_logprobs is None else min(prompt_logprobs, vocab_size),
            grammar=grammar,
            cache_salt=self.cache_salt,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: Any
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequest(f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of")
        if self.stream and (self.best_of or self.n) > self.n:
            raise InvalidRequest(f"best_of ({self.best_of}) > n ({self.n}) cannot be streamed: the likeliest "
                                 "candidates are known only at the end", "best_of")

    @property
    def echo_logprobs(self) -> int | None:
        """Alternatives per echoed prompt token (echo with logprobs), or None."""
        return self.logprobs if self.echo else None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """What the engine must compute for the prompt: the larger of prompt_logprobs and the echo's logprobs."""
        wanted = [n for n in (self.prompt_logprobs, self.echo_logprobs) if n is not None]
        return max(wanted) if wanted else None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Any = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Any] | None = None
    reasoning: str | None = None  # an answer's thinking sent back (vLLM's name), for templates that show it
    reasoning_content: str | None = None  # the same under the older name (Qwen3's template reads this one)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false} (Qwen3), {"thinking": true}
    # tool calling (`afd.server.api.tools`): checked there, as vLLM takes them
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None

    def tool_request(self) -> Tools | None:
        return tools_of(self.tools, self.tool_choice, self.parallel_tool_calls)


def parse_request(model: type[BaseModel], body: dict):
    """`body` as `model`, with type errors turned into a 400 naming the field."""
    try:
        request = model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = field_path(first["loc"])
        raise InvalidRequest(f"{where + ': ' if where else ''}{first['msg']}", where or None) from None
    request.check()
    return request


def field_path(loc) -> str:
    """pydantic's location tuple as `messages[0].content`."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return json_body.short(path, 80)


_KINDS = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
          408: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    message, param = _encodable(message), None if param is None else _encodable(param)
    body = {"error": {"message": message, "type": _KINDS.get(status, "server_error"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _encodable(text: str) -> str:
    """`text` with anything UTF-8 cannot carry (a lone surrogate from the request) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
