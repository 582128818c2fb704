"""The tool-call parser a rank serves with: `tool_call_parser`, or the checkpoint's own (its `config.json`'s
`model_type` and its chat template's markup, `tool_parsers.default_parser`)."""

from __future__ import annotations

import json
import logging
import os

from afd.server.api import tool_parsers

log = logging.getLogger(__name__)


def tool_parser_for(setting: str, model_folder: str, tokenizer) -> tool_parsers.Family | None:
    model_type = None
    try:
        with open(os.path.join(model_folder, "config.json")) as file:
            model_type = json.load(file).get("model_type")
    except (OSError, ValueError):
        pass  # no local config (a hub id): the chat template alone decides
    parser = tool_parsers.chosen(setting, model_type, getattr(tokenizer, "chat_template", None))
    name = next((n for n, p in tool_parsers.PARSERS.items() if p is parser), "none")
    log.info("tool_choice auto reads calls with the %s tool-call parser", name)
    return parser
