"""A request body as a JSON object: strict UTF-8, well-formed Unicode, bounded nesting.

Pure functions raising `InvalidRequest` with the reason, so the API answers 400 in the OpenAI
error format; `short` keeps a huge value out of an error message.
"""

from __future__ import annotations

import json
from typing import Any

from afd.engine.request import InvalidRequest


def parse_json_body(raw: bytes, max_depth: int) -> dict:
    """The request body as a JSON object: strict UTF-8, bounded nesting, no lone surrogates."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidRequest(f"the body is not valid UTF-8 (byte {err.start}: {err.reason})") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise InvalidRequest(f"the body is nested too deeply (at most {max_depth} levels)") from None
    except ValueError as err:  # JSONDecodeError, or an integer literal over Python's digit limit
        raise InvalidRequest(f"the body is not valid JSON: {short(str(err), 200)}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the body must be a JSON object, got a JSON {type(body).__name__}")
    check_json_tree(body, max_depth)
    return body


def check_json_tree(body: Any, max_depth: int) -> None:
    """Every string (keys too) is well-formed Unicode; no value is nested deeper than `max_depth`."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            check_text(path or "body", value)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= max_depth:
            raise InvalidRequest(f"{path or 'the body'} is nested too deeply (at most {max_depth} levels)", path or None)
        if isinstance(value, dict):
            for key, item in value.items():
                shown = short(key.encode("utf-8", "backslashreplace").decode("utf-8"), 40)
                check_text(f"{path}.{shown}" if path else shown, key)
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        else:
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def check_text(name: str, text: str) -> str:
    """`text` encodes to UTF-8 (a lone surrogate such as "\\ud800" does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequest(
            f"{name} is not well-formed Unicode: a lone surrogate {text[err.start]!r} at character {err.start}", name
        ) from None
    return text


def short(text: str, limit: int = 100) -> str:
    """`text` cut to `limit` characters for an error message (a 50 MB model name is not echoed)."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


# -- numbers ---------------------------------------------------------------------------
