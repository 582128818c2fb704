"""The server-sent events of one streamed response, as the bytes `json.dumps` of the chunk would give.

A streamed token is one event, and building the chunk dict then `json.dumps` was a large
part of the loop's cost per token. The common event (no logprobs) is filled into a template
built once per stream; an event with logprobs still goes through `formatting`. Only the text
and the finish reason vary, and `created` is read per event as before.
"""

from __future__ import annotations

import json
import time
from json.encoder import encode_basestring_ascii as _quote  # what json.dumps uses for a str

from afd.engine.request import RequestOutput
from afd.server.formatting import chat_chunk, completion_chunk

DONE = "data: [DONE]\n\n"


def _json(value) -> str:
    return "null" if value is None else _quote(value)


def error_event(message: str) -> str:
    body = {"error": {"message": f"the request failed: {message}", "type": "service_unavailable", "code": 503}}
    return f"data: {json.dumps(body)}\n\n"


class StreamEvents:
    """Events of one stream: `kind` is "text_completion" or "chat.completion.chunk"."""

    def __init__(self, state, request_id: str, kind: str):
        self.state, self.request_id, self.kind = state, request_id, kind
        prefix = {"text_completion": "cmpl", "chat.completion.chunk": "chatcmpl"}[kind]
        self.chunk_id = f"{prefix}-{request_id}"
        self._head = f'data: {{"id": {_quote(self.chunk_id)}, "object": {_quote(kind)}, "created": '
        self._model = f', "model": {_quote(state.model_name)}, "choices": [{{"index": 0, '

    def completion(self, output: RequestOutput, prefix: str) -> str:
        if output.logprobs:
            return f"data: {json.dumps(completion_chunk(self.state, self.request_id, output, prefix))}\n\n"
        return (f'{self._head}{int(time.time())}{self._model}"text": {_quote(prefix + output.text)}, "logprobs": null, '
                f'"finish_reason": {_json(output.finish_reason)}}}]}}\n\n')

    def chat(self, output: RequestOutput, first: bool) -> str:
        if output.logprobs:
            return f"data: {json.dumps(chat_chunk(self.state, self.request_id, output, first))}\n\n"
        role = '"role": "assistant", ' if first else ""
        return (f'{self._head}{int(time.time())}{self._model}"delta": {{{role}"content": {_quote(output.text)}}}, '
                f'"logprobs": null, "finish_reason": {_json(output.finish_reason)}}}]}}\n\n')

    def usage(self, last: RequestOutput) -> str:
        usage = {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                 "total_tokens": last.prompt_tokens + last.completion_tokens}
        chunk = {"id": self.chunk_id, "object": self.kind, "created": int(time.time()),
                 "model": self.state.model_name, "choices": [], "usage": usage}
        return f"data: {json.dumps(chunk)}\n\n"
