"""OpenAI response bodies (completions and chat, whole and streamed) from engine outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from afd.engine.request import RequestOutput, TokenLogprobs
from afd.server.api.answers import AnswerReading, call_id, finish_reason, whole_answer


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens found in the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _usage(outputs: Sequence[RequestOutput]) -> dict:
    last = outputs[-1] if outputs else None
    if last is None:
        return usage_of(0, 0)
    return usage_of(last.prompt_tokens, last.completion_tokens, max(o.cached_tokens for o in outputs))


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


@dataclass(frozen=True)
class PromptShown:
    """What a completions response shows of its prompts: their token ids, the echo's logprobs (alternatives per
    prompt token, None: no echo with logprobs) and vLLM's `prompt_logprobs` field (None: absent)."""

    prompts: list[list[int]]
    echo_logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def wanted(self) -> bool:
        """Whether any prompt logprobs are shown."""
        return self.echo_logprobs is not None or self.prompt_logprobs is not None


def _prompt_entries(outputs: Sequence[RequestOutput]) -> list[TokenLogprobs | None]:
    return next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), [])


def _echo_logprobs(tokenizer, prompt: list[int], entries: list, top: int) -> dict:
    """The echoed prompt's part of a completion's logprobs: the first token's are null, as OpenAI gives them."""
    tokens = [_token_text(tokenizer, t) for t in prompt]
    offsets, position = [], 0
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else _top_by_text(tokenizer, e.top[:top]) for e in entries],
            "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer, entries: list, top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null first, then {token id: {logprob, rank, decoded_token}} for
    the prompt token and the `top` likeliest."""
    shown: list[dict | None] = []
    for entry in entries:
        if entry is None:
            shown.append(None)
            continue
        item = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank,
                                      "decoded_token": _token_text(tokenizer, entry.token_id)}}
        for rank, (token, logprob) in enumerate(entry.top[:top], start=1):
            item.setdefault(str(token), {"logprob": logprob, "rank": rank, "decoded_token": _token_text(tokenizer, token)})
        shown.append(item)
    return shown


def completion_response(state, results: list[list[RequestOutput]], echo: list[str],
                        shown: PromptShown | None = None, usage: dict | None = None) -> dict:
    """One choice per entry of `results` (its prefix in `echo`); `usage` when it is not the choices' sum (n > 1)."""
    choices, totals = [], usage_of(0, 0)
    for index, (outputs, prefix) in enumerate(zip(results, echo)):
        text = prefix + "".join(o.text for o in outputs)
        entries = [e for o in outputs for e in o.logprobs]
        logprobs = _completion_logprobs(state.tokenizer, entries, len(prefix))
        if shown is not None and shown.echo_logprobs is not None:
            echoed = _echo_logprobs(state.tokenizer, shown.prompts[index], _prompt_entries(outputs), shown.echo_logprobs)
            logprobs = echoed if logprobs is None else {key: echoed[key] + logprobs[key] for key in echoed}
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": outputs[-1].finish_reason if outputs else "abort",
        }
        if shown is not None and shown.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(state.tokenizer, _prompt_entries(outputs),
                                                             shown.prompt_logprobs)
        choices.append(choice)
        for key, value in _usage(outputs).items():
            if key == "prompt_tokens_details":
                totals[key]["cached_tokens"] += value["cached_tokens"]
            else:
                totals[key] += value
    usage = usage or totals
    request_id = results[0][-1].request_id if results and results[0] else "cmpl"
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
            "model": state.model_name, "choices": choices, "usage": usage}


def completion_chunk(state, request_id: str, output: RequestOutput, prefix: str, index: int = 0, offset: int = 0,
                     shown: PromptShown | None = None) -> dict:
    """One streamed choice's chunk: its text after `prefix` (the echo, on its first chunk); token offsets from
    `offset`; `shown` (first chunk only): the echoed prompt's logprobs and vLLM's `prompt_logprobs`, as non-streamed."""
    logprobs = _completion_logprobs(state.tokenizer, output.logprobs, offset + len(prefix))
    choice = {"index": index, "text": prefix + output.text, "logprobs": logprobs, "finish_reason": output.finish_reason}
    if shown is not None:
        entries = output.prompt_logprobs or []
        if shown.echo_logprobs is not None:
            echoed = _echo_logprobs(state.tokenizer, shown.prompts[0], entries, shown.echo_logprobs)
            choice["logprobs"] = echoed if logprobs is None else {key: echoed[key] + logprobs[key] for key in echoed}
        if shown.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(state.tokenizer, entries, shown.prompt_logprobs)
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
            "model": state.model_name, "choices": [choice]}


def chat_response(state, request_id: str, results: list[list[RequestOutput]], prompt_logprobs: int | None = None,
                  usage: dict | None = None, reading: AnswerReading | None = None) -> dict:
    """One choice per entry of `results` (n of them); `usage` default: the first choice's; `reading`: how the answers
    are read (thinking split off, tool calls read), None: as they are."""
    reading = reading or AnswerReading()
    choices = []
    for index, outputs in enumerate(results):
        message, called = assistant_message(state, "".join(o.text for o in outputs), reading)
        reason = outputs[-1].finish_reason if outputs else "abort"
        choices.append({"index": index, "message": message,
                        "logprobs": _chat_logprobs(state.tokenizer, [e for o in outputs for e in o.logprobs]),
                        "finish_reason": finish_reason(reading, called, reason, streamed=False)})
    response = {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()),
                "model": state.model_name, "choices": choices, "usage": usage or _usage(results[0])}
    if prompt_logprobs is not None:  # vLLM's field, beside the choices
        response["prompt_logprobs"] = vllm_prompt_logprobs(state.tokenizer, _prompt_entries(results[0]),
                                                           prompt_logprobs)
    return response


def assistant_message(state, text: str, reading: AnswerReading) -> tuple[dict, bool]:
    """A whole answer's message and whether it called tools: with a reasoning parser, its thinking as `reasoning`
    (and `reasoning_content` where `state.reasoning_content`), the rest as `content` (None where empty, as vLLM);
    calls read from it as `tool_calls`."""
    if reading.thinking_family is None and not reading.reads_calls:
        return {"role": "assistant", "content": text}, False
    reasoning, content, calls = whole_answer(reading, text)
    forced = reading.reads_calls and reading.tools.forced
    message = {"role": "assistant", "content": "" if forced else content}  # vLLM's forced choices: empty content
    if reading.thinking_family is not None:
        message.update(reasoning_fields(state, reasoning))
    if calls:
        message["tool_calls"] = [{"id": call_id(), "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}} for call in calls]
    return message, bool(calls)


def reasoning_fields(state, reasoning: str | None) -> dict:
    return {"reasoning": reasoning, **({"reasoning_content": reasoning} if state.reasoning_content else {})}


def chat_chunk(state, request_id: str, output: RequestOutput, first: bool, index: int = 0,
               prompt_logprobs: int | None = None, parts: tuple | None = None) -> dict:
    """One streamed choice's chunk (the role on its `first`); `prompt_logprobs`: vLLM's field beside the choices, from
    this output's prompt entries (the stream's first chunk only); `parts`: the (reasoning, content, tool calls,
    finish reason) of this output's text, where the answer is read (`afd.server.api.answers`)."""
    finish = output.finish_reason
    if parts is None:
        delta = {"content": output.text}
    else:  # the fields that have text (content "" where none has: a chunk that only ends the choice)
        reasoning, content, calls, finish = parts
        delta = {**(reasoning_fields(state, reasoning) if reasoning else {}),
                 **({"content": content} if content or not (reasoning or calls) else {}),
                 **({"tool_calls": calls} if calls else {})}
    if first:
        delta = {"role": "assistant", **delta}
    choice = {"index": index, "delta": delta, "logprobs": _chat_logprobs(state.tokenizer, output.logprobs),
              "finish_reason": finish}
    chunk = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": int(time.time()),
             "model": state.model_name, "choices": [choice]}
    if prompt_logprobs is not None:
        chunk["prompt_logprobs"] = vllm_prompt_logprobs(state.tokenizer, output.prompt_logprobs or [], prompt_logprobs)
    return chunk
