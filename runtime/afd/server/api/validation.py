"""Checks on request values before they reach the tokenizer, the sampler, the KV allocator or torch.

Pure functions: each takes plain values (parsed JSON) and returns the checked value or
raises `InvalidRequest` naming the field, so the API answers 400 in the OpenAI error
format. Types come from the pydantic models in `protocol`; ranges, string
well-formedness, counts and the unsupported-field policy live here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from afd.engine.request import MAX_BANNED_SEQUENCE, MAX_LOGPROBS, MAX_REPETITION_PENALTY, InvalidRequest
from afd.server.api.json_body import check_text, short

MAX_TEMPERATURE = 100.0
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
CHARS_PER_TOKEN_ALLOWANCE = 32  # default prompt-length limit before tokenization, per context token


@dataclass(frozen=True)
class Limits:
    """Bounds on one request. The first three are settings (`AFD_MAX_*`, `afd up` flags)."""

    max_request_bytes: int = 16 << 20
    max_prompts: int = 128  # prompts in one /v1/completions request
    max_prompt_chars: int = 131072  # characters of one prompt (or all chat messages) before tokenization
    max_json_depth: int = 32
    max_messages: int = 4096
    max_content_parts: int = 256
    max_stop: int = 64
    max_stop_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024  # entries of logit_bias
    max_bad_words: int = 256
    max_allowed_token_ids: int = 1 << 20

    @classmethod
    def for_server(cls, max_request_bytes: int, max_prompts: int, max_prompt_chars: int, max_model_len: int) -> "Limits":
        """Limits from the settings; `max_prompt_chars=0` means 32 characters per context token."""
        chars = max_prompt_chars or CHARS_PER_TOKEN_ALLOWANCE * max_model_len
        return cls(max_request_bytes=max_request_bytes, max_prompts=max_prompts, max_prompt_chars=chars)


def number_in(name: str, value: float | None, low: float, high: float, low_open: bool = False) -> float | None:
    """A finite number in [low, high] (or (low, high] with `low_open`); None passes."""
    if value is None:
        return None
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value}", name)
    if value < low or (low_open and value == low) or value > high:
        raise InvalidRequest(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value}", name)
    return float(value)


def int_in(name: str, value: int | None, low: int, high: int) -> int | None:
    """An integer in [low, high]; None passes."""
    if value is None:
        return None
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be an integer in {low}..{high}, got {short(str(value), 40)}", name)
    return value


NUMBER_BOUNDS: dict[str, tuple[float, float, bool]] = {  # name: (low, high, low is open)
    "temperature": (0.0, MAX_TEMPERATURE, False),
    "top_p": (0.0, 1.0, True),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "repetition_penalty": (0.0, MAX_REPETITION_PENALTY, True),
    "min_p": (0.0, 1.0, False),
}
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "top_k": (-1, INT32_MAX),
    "seed": SEED_RANGE,
    "n": (1, 128),
    "best_of": (1, 128),
    "max_tokens": (1, INT64_MAX),  # the context length bounds it further, with its own message
    "max_completion_tokens": (1, INT64_MAX),
    "logprobs": (0, MAX_LOGPROBS),
    "top_logprobs": (0, MAX_LOGPROBS),
    "prompt_logprobs": (0, MAX_LOGPROBS),
    "min_tokens": (0, INT64_MAX),
}


def check_bounds(values: Mapping[str, Any]) -> None:
    """Every known numeric field in `values` within its range (booleans and None skipped)."""
    for name, (low, high, low_open) in NUMBER_BOUNDS.items():
        number_in(name, values.get(name), low, high, low_open)
    for name, (low, high) in INT_BOUNDS.items():
        value = values.get(name)
        if not isinstance(value, bool):
            int_in(name, value, low, high)


# -- fields we do not implement -----------------------------------------------------------
# Accepted only with a value that asks for nothing (what a client sends by default).
# Anything else not declared by the request model is refused: OpenAI does the same.
_NEUTRAL: dict[str, tuple] = {
    "user": (),  # any string: metadata that never changes the output
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "best_of": (1,),
    "suffix": ("",),
    "store": (False,),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
}
_WHY = {
    "tools": "tool calling is not supported",
    "functions": "function calling is not supported",
    "best_of": "best_of is for /v1/completions",
    "suffix": "insertion is not supported",
}


def refuse_unsupported(extra: Mapping[str, Any]) -> None:
    """400 for the first undeclared field whose value would ask for something we do not do."""
    for name, value in extra.items():
        if name == "user" and isinstance(value, str):
            continue
        if name in _NEUTRAL and (value is None or value in _NEUTRAL[name]):
            continue
        shown = short(name, 40)
        if name in _NEUTRAL:
            why = _WHY.get(name, f"{short(json.dumps(value), 60)} is not supported")
            raise InvalidRequest(f"{name}: {why}; leave it out", name)
        raise InvalidRequest(f"unknown field {shown!r}: this server does not implement it; leave it out", shown)


# -- prompts ---------------------------------------------------------------------------
def completion_prompts(prompt: Any, limits: Limits, vocab_size: int, max_model_len: int) -> list[str | list[int]]:
    """The prompts of a completions request: strings or token-id lists, counted and bounded."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_int(prompt[0])):
        prompts = [prompt]
    elif isinstance(prompt, list):
        prompts = prompt
    else:
        raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids or a list of such lists", "prompt")
    if not prompts:
        raise InvalidRequest("prompt is empty", "prompt")
    if len(prompts) > limits.max_prompts:
        raise InvalidRequest(
            f"prompt has {len(prompts)} prompts; at most {limits.max_prompts} per request (AFD_MAX_PROMPTS)", "prompt")
    for index, item in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{index}]"
        if isinstance(item, str):
            prompt_text(where, item, limits)
        elif isinstance(item, list):
            token_ids(where, item, vocab_size, max_model_len)
        else:
            raise InvalidRequest(f"{where} must be a string or a list of token ids", "prompt")
    if len({type(p) for p in prompts}) > 1:
        raise InvalidRequest("prompt mixes strings and token-id lists", "prompt")
    return prompts


def prompt_text(name: str, text: str, limits: Limits) -> str:
    if not text:
        raise InvalidRequest(f"{name} is empty", name.split("[")[0])
    if len(text) > limits.max_prompt_chars:
        raise InvalidRequest(
            f"{name} has {len(text)} characters; at most {limits.max_prompt_chars} are accepted before tokenization "
            f"(AFD_MAX_PROMPT_CHARS)", name.split("[")[0])
    return check_text(name, text)


def token_ids(name: str, ids: list, vocab_size: int, max_model_len: int) -> list[int]:
    field = name.split("[")[0]
    if not ids:
        raise InvalidRequest(f"{name} is empty", field)
    if len(ids) >= max_model_len:
        raise InvalidRequest(
            f"this model's maximum context length is {max_model_len} tokens, and {name} has {len(ids)}", field)
    if not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"{name}: prompt token ids must be integers in 0..{vocab_size - 1}", field)
    return ids


def stop_strings(stop: Any, limits: Limits) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidRequest("stop must be a string or a list of strings", "stop")
    if len(items) > limits.max_stop:
        raise InvalidRequest(f"stop has {len(items)} strings; at most {limits.max_stop}", "stop")
    for s in items:
        if not s or len(s) > limits.max_stop_chars:
            raise InvalidRequest(f"each stop string must have 1..{limits.max_stop_chars} characters", "stop")
        check_text("stop", s)
    return tuple(items)


def stop_token_ids(ids: list[int] | None, vocab_size: int, limits: Limits) -> tuple[int, ...]:
    ids = ids or []
    if len(ids) > limits.max_stop_token_ids:
        raise InvalidRequest(f"stop_token_ids has {len(ids)} ids; at most {limits.max_stop_token_ids}", "stop_token_ids")
    if not all(0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"stop_token_ids must be in 0..{vocab_size - 1}", "stop_token_ids")
    return tuple(ids)


# -- logits controls -------------------------------------------------------------------
MAX_LOGIT_BIAS = 100.0


def logit_bias(bias: Mapping[str, float] | None, vocab_size: int, limits: Limits) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token id as a string -> a bias in [-100, 100]) as sorted (id, bias) pairs."""
    if not bias:
        return ()
    if len(bias) > limits.max_logit_bias:
        raise InvalidRequest(f"logit_bias has {len(bias)} entries; at most {limits.max_logit_bias}", "logit_bias")
    pairs = []
    for key, value in bias.items():
        token = key.strip()
        if not (token.isdigit() and int(token) < vocab_size):
            raise InvalidRequest(f"logit_bias keys must be token ids in 0..{vocab_size - 1}, got {short(key, 40)!r}",
                                 "logit_bias")
        pairs.append((int(token), number_in("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)))
    return tuple(sorted(pairs))


def allowed_token_ids(ids: list[int] | None, vocab_size: int, limits: Limits) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not ids:
        raise InvalidRequest("allowed_token_ids is empty: nothing could be sampled", "allowed_token_ids")
    if len(ids) > limits.max_allowed_token_ids:
        raise InvalidRequest(f"allowed_token_ids has {len(ids)} ids; at most {limits.max_allowed_token_ids}",
                             "allowed_token_ids")
    if not all(0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"allowed_token_ids must be in 0..{vocab_size - 1}", "allowed_token_ids")
    return tuple(sorted(set(ids)))


def bad_words(words: list[str] | None, tokenizer,
              limits: Limits) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(token ids never to sample, multi-token words) of `bad_words`, tokenized as vLLM does: each word with its
    leading spaces stripped, and after one space when that gives other tokens of the same count. A word of
    several tokens bans its last token where the others end the output (`afd.engine.sampling.banned_words`)."""
    if not words:
        return (), ()
    if len(words) > limits.max_bad_words:
        raise InvalidRequest(f"bad_words has {len(words)} words; at most {limits.max_bad_words}", "bad_words")
    banned, sequences = set(), set()
    for word in words:
        if not word.strip():
            raise InvalidRequest("bad_words entries must not be empty", "bad_words")
        check_text("bad_words", word)
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not bare:
            raise InvalidRequest(f"bad_words: {short(word, 40)!r} gives no token", "bad_words")
        variants = [bare] + ([spaced] if spaced and spaced[0] != bare[0] and len(spaced) == len(bare) else [])
        for ids in variants:
            if len(ids) > MAX_BANNED_SEQUENCE:
                raise InvalidRequest(f"bad_words: {short(word, 40)!r} is {len(ids)} tokens; at most "
                                     f"{MAX_BANNED_SEQUENCE}", "bad_words")
            if len(ids) == 1:
                banned.add(ids[0])
            else:
                sequences.add(tuple(ids))
    return tuple(sorted(banned)), tuple(sorted(sequences))


# -- chat ------------------------------------------------------------------------------
_NOT_TEXT = {"image_url": "image", "input_image": "image", "image": "image", "image_pil": "image",
             "image_embeds": "image", "input_audio": "audio", "audio_url": "audio", "audio": "audio",
             "video_url": "video", "video": "video", "file": "file", "input_file": "file"}


def chat_content(content: Any, where: str) -> str | None:
    """A message's content as text: a string, or its text parts joined by newlines (as vLLM does)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of content parts", where)
    texts = []
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _NOT_TEXT:
            raise InvalidRequest(f"{at}: this model takes text only; {_NOT_TEXT[kind]} parts ({kind}) are not supported", at)
        if kind != "text":
            raise InvalidRequest(f"{at}: expected a content part {{'type': 'text', 'text': ...}}, got type "
                                 f"{short(repr(kind), 40)}", at)
        unknown = sorted(set(part) - {"type", "text"})
        if unknown:
            raise InvalidRequest(f"{at}: unknown key {short(unknown[0], 40)!r} in a text part", at)
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{at}.text must be a string", f"{at}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_messages(messages: Iterable[Mapping[str, Any]], limits: Limits) -> list[dict]:
    """Messages ready for the chat template: text content only, counted and bounded."""
    messages = list(messages)
    if len(messages) > limits.max_messages:
        raise InvalidRequest(f"messages has {len(messages)} entries; at most {limits.max_messages}", "messages")
    result, chars = [], 0
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        content = message.get("content")
        if isinstance(content, list) and len(content) > limits.max_content_parts:
            raise InvalidRequest(f"{where}.content has {len(content)} parts; at most {limits.max_content_parts}",
                                 f"{where}.content")
        calls = tool_calls(message.get("tool_calls"), f"{where}.tool_calls")
        text = chat_content(content, f"{where}.content")
        chars += len(text or "") + len(message.get("name") or "") + len(message.get("reasoning") or "") + \
            len(message.get("reasoning_content") or "") + sum(len(c["function"]["arguments"]) for c in calls)
        result.append({k: v for k, v in {**message, "content": text, "tool_calls": calls or None}.items()
                       if v is not None})
    if chars > limits.max_prompt_chars:
        raise InvalidRequest(
            f"messages have {chars} characters; at most {limits.max_prompt_chars} are accepted before tokenization "
            f"(AFD_MAX_PROMPT_CHARS)", "messages")
    return result


def tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as sent back (OpenAI's form, arguments a JSON string), for the template."""
    if calls is None or calls == []:
        return []
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where} must be a list", where)
    checked = []
    for index, call in enumerate(calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"{at} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", at)
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise InvalidRequest(f"{at}.function.arguments must be a JSON string", f"{at}.function.arguments")
        checked.append({"id": str(call.get("id") or f"call_{index}"), "type": "function",
                        "function": {"name": function["name"], "arguments": arguments}})
    return checked


# apply_chat_template's own parameters: a request's template variables may not set them
_TEMPLATE_OWN = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                           "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                           "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs`: variables for the chat template (e.g. `enable_thinking`), none of the renderer's own."""
    for name in kwargs or {}:
        if name in _TEMPLATE_OWN:
            raise InvalidRequest(f"chat_template_kwargs.{name}: set by the server, not by a request",
                                 "chat_template_kwargs")
    return dict(kwargs or {})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
