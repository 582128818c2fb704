"""The tool-call parser a rank serves with: `tool_call_parser`, or the checkpoint's own (its `config.json`'s
`model_type` and its chat template's markup, `tool_parsers.default_parser`)."""

from __future__ import annotations

import json
import logging
import os

from afd.server.api import tool_parsers

log = logging.getLogger(__name__)


def tool_parser_name(setting: str, model_folder: str, chat_template: str | None = None) -> str | None:
    """The parser's name (None: calls are not read); `chat_template` default: the folder's (tokenizer_config.json or
    chat_template.jinja)."""
    if setting == "none":
        return None
    if setting:
        return setting
    model_type = _json(model_folder, "config.json").get("model_type")
    if chat_template is None:
        chat_template = _json(model_folder, "tokenizer_config.json").get("chat_template") or _text(
            model_folder, "chat_template.jinja")
    return tool_parsers.default_parser(model_type, chat_template if isinstance(chat_template, str) else None)


def tool_parser_for(setting: str, model_folder: str, tokenizer) -> tool_parsers.Family | None:
    """The parser the API reads `tool_choice: auto` calls with (the tokenizer's chat template decides the default)."""
    name = tool_parser_name(setting, model_folder, getattr(tokenizer, "chat_template", None) or "")
    log.info("tool_choice auto reads calls with the %s tool-call parser", name or "no")
    return tool_parsers.PARSERS.get(name or "")


def _json(folder: str, name: str) -> dict:
    try:
        with open(os.path.join(folder, name)) as file:
            found = json.load(file)
    except (OSError, ValueError):
        return {}  # no local file (a hub id): the rest decides
    return found if isinstance(found, dict) else {}


def _text(folder: str, name: str) -> str:
    try:
        with open(os.path.join(folder, name)) as file:
            return file.read()
    except OSError:
        return ""
