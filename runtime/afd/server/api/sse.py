"""The server-sent events of one streamed response, as the bytes `json.dumps` of the chunk would give.

A streamed token is one event, and building the chunk dict then `json.dumps` was a large
part of the loop's cost per token. The common event (no logprobs) is filled into a template
built once per stream; an event with logprobs (or the prompt's, on a first chunk) still goes through
`formatting`. Only the choice's index, the text and the finish reason vary, and `created` is read per event.
"""

from __future__ import annotations

import json
import time
from json.encoder import encode_basestring_ascii as _quote  # what json.dumps uses for a str

from afd.engine.request import RequestOutput
from afd.server.api.answers import finish_reason
from afd.server.api.formatting import PromptShown, chat_chunk, completion_chunk, usage_of

DONE = "data: [DONE]\n\n"


def _json(value) -> str:
    return "null" if value is None else _quote(value)


def error_event(message: str) -> str:
    body = {"error": {"message": f"the request failed: {message}", "type": "service_unavailable", "code": 503}}
    return f"data: {json.dumps(body)}\n\n"


class StreamEvents:
    """Events of one stream: `kind` is "text_completion" or "chat.completion.chunk". Its choices (n of them) each
    carry their `index`; a choice's token offsets (completions' logprobs) run on over its chunks.
    `shown`: what a completions stream shows of the prompt on each choice's first chunk (echo logprobs, vLLM's
    `prompt_logprobs`), or for chat the `prompt_logprobs` alternatives given once, on the stream's first chunk."""

    def __init__(self, state, request_id: str, kind: str, shown: PromptShown | None = None, answers=None):
        self.state, self.request_id, self.kind, self.shown = state, request_id, kind, shown
        self.answers = answers  # chat with its answers read: makes choice i's `answers.AnswerStream` (`answers(i)`)
        self._answer_of: dict = {}
        prefix = {"text_completion": "cmpl", "chat.completion.chunk": "chatcmpl"}[kind]
        self.chunk_id = f"{prefix}-{request_id}"
        self._head = f'data: {{"id": {_quote(self.chunk_id)}, "object": {_quote(kind)}, "created": '
        self._model = f', "model": {_quote(state.model_name)}, "choices": [{{"index": '
        self._first_choice = f'{self._model}0, '  # n = 1: the index is always 0
        self._shows_prompt = shown is not None and shown.wanted
        self._offsets: dict[int, int] = {}  # each choice's next text offset, once it has shown logprobs
        self._prompt_shown = False

    def completion(self, output: RequestOutput, prefix: str, index: int = 0, first: bool = False) -> str:
        """`first`: the choice's first chunk on this stream (its echo `prefix` and the prompt's logprobs with it)."""
        shown = self.shown if first and self._shows_prompt else None
        if output.logprobs or shown is not None:
            chunk = completion_chunk(self.state, self.request_id, output, prefix, index, self._offsets.get(index, 0),
                                     shown)
            logprobs = chunk["choices"][0]["logprobs"]
            if logprobs and logprobs["tokens"]:
                self._offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            return f"data: {json.dumps(chunk)}\n\n"
        choice = self._first_choice if index == 0 else f"{self._model}{index}, "
        return (f'{self._head}{int(time.time())}{choice}"text": {_quote(prefix + output.text)}, '
                f'"logprobs": null, "finish_reason": {_json(output.finish_reason)}}}]}}\n\n')

    def chat(self, output: RequestOutput, first: bool, index: int = 0, show_prompt: bool = False) -> str:
        """`first`: the choice's first chunk (its role); `show_prompt`: this stream may show the prompt's logprobs
        (not a moved stream), given on the first chunk that carries them."""
        prompt_logprobs = None
        if show_prompt and self._shows_prompt and not self._prompt_shown and output.prompt_logprobs is not None:
            prompt_logprobs, self._prompt_shown = self.shown.prompt_logprobs, True
        if output.logprobs or prompt_logprobs is not None or self.answers is not None:
            chunk = chat_chunk(self.state, self.request_id, output, first, index, prompt_logprobs, self._parts(output, index))
            return f"data: {json.dumps(chunk)}\n\n"
        role = '"role": "assistant", ' if first else ""
        choice = self._first_choice if index == 0 else f"{self._model}{index}, "
        return (f'{self._head}{int(time.time())}{choice}"delta": {{{role}"content": {_quote(output.text)}}}, '
                f'"logprobs": null, "finish_reason": {_json(output.finish_reason)}}}]}}\n\n')

    def _parts(self, output: RequestOutput, index: int) -> tuple | None:
        """The (reasoning, content, tool calls, finish reason) of choice `index`'s new text; all that was held back
        once it finished."""
        if self.answers is None:
            return None
        if index not in self._answer_of:
            self._answer_of[index] = self.answers(index)
        answer = self._answer_of[index]
        reasoning, content, deltas = answer.feed(output.text)
        if output.finished:
            more_reasoning, more_content, more_deltas = answer.finish()
            reasoning, content, deltas = reasoning + more_reasoning, content + more_content, deltas + more_deltas
        finish = finish_reason(answer.reading, answer.called, output.finish_reason, streamed=True)
        return reasoning, content, answer.tool_calls(deltas), finish

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> str:
        """The last chunk's usage: the prompt once, every choice's tokens."""
        usage = usage_of(prompt_tokens, completion_tokens, cached_tokens)
        chunk = {"id": self.chunk_id, "object": self.kind, "created": int(time.time()),
                 "model": self.state.model_name, "choices": [], "usage": usage}
        return f"data: {json.dumps(chunk)}\n\n"
