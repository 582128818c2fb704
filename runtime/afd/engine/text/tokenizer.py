"""The checkpoint's Hugging Face tokenizer and chat template."""

from __future__ import annotations

from typing import Callable

from afd.engine.request import InvalidRequest

_FAST_DECODE_MODULES = ("transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast")
_decoders: dict[int, tuple[object, Callable[[list[int]], str]]] = {}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer  # local import: transformers takes seconds to import; only loading needs it

    return AutoTokenizer.from_pretrained(path)


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` rendered by the checkpoint's chat template, ready for the reply (or, with
    `continue_final_message`, ending inside the last message); `template_kwargs`: the template's own variables
    (`enable_thinking`, `thinking`); `tools`: the request's function tools, as OpenAI's `tools` list."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            continue_final_message=continue_final_message, tools=tools or None,
                                            **(template_kwargs or {}))
    except Exception as err:  # jinja errors for unexpected message shapes
        raise InvalidRequest(f"cannot render the chat template: {err}", "messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def text_decoder(tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=..., spaces_between_special_tokens=...)`, as a function of `ids`.

    For a Hugging Face fast tokenizer whose decoding transformers does not change afterwards
    (no subclass override, no `clean_up_tokenization_spaces`), the Rust tokenizer is called
    directly: the same text at a fifth of the cost (transformers' wrapper is ~10 µs per call,
    and streaming decodes twice per token). Anything else goes through `decode`.
    """
    key = (id(tokenizer), skip_special_tokens, spaces_between_special_tokens)
    cached = _decoders.get(key)
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    backend = getattr(tokenizer, "_tokenizer", None)
    owner = next((k for k in type(tokenizer).__mro__ if "_decode" in vars(k)), None)
    plain = (backend is not None and owner is not None and owner.__module__ in _FAST_DECODE_MODULES
             and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
             and not any("decode" in vars(k) for k in type(tokenizer).__mro__[: type(tokenizer).__mro__.index(owner)]))
    if plain:  # the Rust decoder has no spaces_between_special_tokens (transformers ignores it for fast tokenizers)
        decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)  # noqa: E731
    elif spaces_between_special_tokens:
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)  # noqa: E731
    else:
        decode = lambda ids: tokenizer.decode(  # noqa: E731
            ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False)
    _decoders[key] = (tokenizer, decode)
    return decode
