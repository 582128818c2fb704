"""OpenAI request bodies (what we accept, typed) and error bodies (what clients parse)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from afd.engine.request import InvalidRequest, SamplingParams

Number = StrictFloat | StrictInt


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are accepted and ignored

    model: StrictStr
    stream: StrictBool = False
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    n: StrictInt = 1
    presence_penalty: Number = 0
    frequency_penalty: Number = 0
    stream_options: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise InvalidRequest(f"n={self.n}: only n=1 is supported", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidRequest(f"{name} is not supported; leave it at 0", name)

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        self.check_unsupported()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kinds = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable"}
    body = {"error": {"message": message, "type": kinds.get(status, "server_error"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status)
