"""`/tokenize` and `/detokenize` as vLLM serves them: bodies, checks and answers (no HTTP here).

`/tokenize` takes a completion form (`prompt`, `add_special_tokens` default true) or a chat form
(`messages` rendered by the chat template, `add_generation_prompt` default true,
`add_special_tokens` default false) and answers `{"count", "max_model_len", "tokens",
"token_strs"}` (`token_strs` only with `return_token_strs`). `/detokenize` takes `tokens` and
answers `{"prompt"}`. `model` is optional, as in vLLM; when given it must be the served one.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from afd.engine.request import InvalidRequest
from afd.engine.text.tokenizer import chat_prompt_ids
from afd.server.api import validation
from afd.server.api.protocol import ChatMessage, parse_request
from afd.server.api.validation import Limits


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give either prompt or messages", "prompt" if self.prompt is None else "messages")
        if self.messages is not None and not self.messages:
            raise InvalidRequest("messages is empty", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true",
                                 "continue_final_message")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]

    def check(self) -> None:
        pass


def tokenize(body: dict, tokenizer, limits: Limits, max_model_len: int) -> tuple[str | None, dict]:
    """(the model named, the answer) of a /tokenize body; `InvalidRequest` naming the field."""
    request = parse_request(TokenizeRequest, body)
    if request.prompt is not None:
        validation.prompt_text("prompt", request.prompt, limits)
        special = True if request.add_special_tokens is None else request.add_special_tokens
        ids = list(tokenizer.encode(request.prompt, add_special_tokens=special))
    else:
        messages = validation.chat_messages([m.model_dump(exclude_none=True) for m in request.messages], limits)
        ids = chat_prompt_ids(tokenizer, messages, add_generation_prompt=request.add_generation_prompt,
                              continue_final_message=request.continue_final_message)
        if request.add_special_tokens:  # as vLLM: the rendered text encoded with the tokenizer's special tokens too
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt,
                                                 continue_final_message=request.continue_final_message, tokenize=False)
            ids = list(tokenizer.encode(text, add_special_tokens=True))
    answer = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
              "token_strs": tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None}
    return request.model, answer


def detokenize(body: dict, tokenizer, limits: Limits, vocab_size: int) -> tuple[str | None, dict]:
    """(the model named, the answer) of a /detokenize body; `InvalidRequest` naming the field."""
    request = parse_request(DetokenizeRequest, body)
    if len(request.tokens) > limits.max_prompt_chars:
        raise InvalidRequest(f"tokens has {len(request.tokens)} ids; at most {limits.max_prompt_chars}", "tokens")
    if not all(0 <= t < vocab_size for t in request.tokens):
        raise InvalidRequest(f"tokens must be token ids in 0..{vocab_size - 1}", "tokens")
    return request.model, {"prompt": tokenizer.decode(request.tokens)}
