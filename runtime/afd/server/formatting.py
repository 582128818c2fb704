"""OpenAI response bodies (completions and chat, whole and streamed) from engine outputs."""

from __future__ import annotations

import time
from typing import Sequence

from afd.engine.request import RequestOutput, TokenLogprobs


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _usage(outputs: Sequence[RequestOutput]) -> dict:
    last = outputs[-1] if outputs else None
    prompt = last.prompt_tokens if last else 0
    completion = last.completion_tokens if last else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_logprobs(tokenizer, entries: list[TokenLogprobs], offset: int) -> dict | None:
    if not entries:
        return None
    tokens = [_token_text(tokenizer, e.token_id) for e in entries]
    offsets, position = [], offset
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_top_by_text(tokenizer, e.top) for e in entries],
        "text_offset": offsets,
    }


def _top_by_text(tokenizer, top: list[tuple[int, float]]) -> dict[str, float]:
    """OpenAI keys alternatives by text. When a token decodes like a likelier one (partial UTF-8
    bytes all decode to U+FFFD), it is keyed `token_id:<id>` (vLLM's spelling), so a request
    for N alternatives gets exactly N entries."""
    result: dict[str, float] = {}
    for token_id, logprob in top:
        text = _token_text(tokenizer, token_id)
        result[f"token_id:{token_id}" if text in result else text] = logprob
    return result


def _chat_logprobs(tokenizer, entries: list[TokenLogprobs]) -> dict | None:
    if not entries:
        return None

    def item(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


def completion_response(state, results: list[list[RequestOutput]], echo: list[str]) -> dict:
    choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for index, (outputs, prefix) in enumerate(zip(results, echo)):
        text = prefix + "".join(o.text for o in outputs)
        entries = [e for o in outputs for e in o.logprobs]
        choices.append({
            "index": index,
            "text": text,
            "logprobs": _completion_logprobs(state.tokenizer, entries, len(prefix)),
            "finish_reason": outputs[-1].finish_reason if outputs else "abort",
        })
        for key, value in _usage(outputs).items():
            usage[key] += value
    request_id = results[0][-1].request_id if results and results[0] else "cmpl"
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
            "model": state.model_name, "choices": choices, "usage": usage}


def completion_chunk(state, request_id: str, output: RequestOutput, prefix: str) -> dict:
    choice = {
        "index": 0,
        "text": prefix + output.text,
        "logprobs": _completion_logprobs(state.tokenizer, output.logprobs, 0),
        "finish_reason": output.finish_reason,
    }
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
            "model": state.model_name, "choices": [choice]}


def chat_response(state, request_id: str, outputs: list[RequestOutput]) -> dict:
    entries = [e for o in outputs for e in o.logprobs]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "".join(o.text for o in outputs)},
        "logprobs": _chat_logprobs(state.tokenizer, entries),
        "finish_reason": outputs[-1].finish_reason if outputs else "abort",
    }
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()),
            "model": state.model_name, "choices": [choice], "usage": _usage(outputs)}


def chat_chunk(state, request_id: str, output: RequestOutput, first: bool) -> dict:
    delta = {"role": "assistant", "content": output.text} if first else {"content": output.text}
    choice = {"index": 0, "delta": delta, "logprobs": _chat_logprobs(state.tokenizer, output.logprobs),
              "finish_reason": output.finish_reason}
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": state.model_name, "choices": [choice]}
