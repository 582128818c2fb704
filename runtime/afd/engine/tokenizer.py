"""The checkpoint's Hugging Face tokenizer and chat template."""

from __future__ import annotations

from afd.engine.request import InvalidRequest


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered by the checkpoint's chat template, ready for the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as err:  # jinja errors for unexpected message shapes
        raise InvalidRequest(f"cannot render the chat template: {err}", "messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
