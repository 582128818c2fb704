"""Structured-output request fields as one llguidance grammar: OpenAI's `response_format` and vLLM's
`guided_json`/`guided_regex`/`guided_choice`/`guided_grammar` and `structured_outputs` form.

Pure translation and checks: at most one constraint per request; a JSON schema must be an
object (or a JSON string of one); a choice list non-empty strings. JSON is compact (no free
whitespace between tokens), so a weak model cannot wander in blanks. The grammar is compiled
(and cached) by `afd.engine.structured_output.grammars.Grammars`, which names the field if it does not compile.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from llguidance import LLMatcher

from afd.engine.request import InvalidRequest

JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT = {"type": "object"}


def grammar_of(fields: Mapping[str, Any]) -> tuple[str, str] | None:
    """(llguidance grammar, the field it came from) of a request's structured-output fields, or None."""
    found = [(name, value) for name, value in _constraints(fields) if value is not None]
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequest(f"only one structured-output constraint per request; got {names}", found[1][0])
    name, (kind, value) = found[0]
    return _grammar(kind, value, name), name


def _constraints(fields: Mapping[str, Any]):
    """(field, (kind, value) or None) for every place a constraint can come from."""
    yield "response_format", _response_format(fields.get("response_format"))
    for kind in ("json", "regex", "choice", "grammar"):
        value = fields.get(f"guided_{kind}")
        yield f"guided_{kind}", None if value is None else (kind, value)
    outputs = fields.get("structured_outputs")
    if outputs is None:
        return
    if not isinstance(outputs, dict):
        raise InvalidRequest("structured_outputs must be an object", "structured_outputs")
    known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace", "disable_fallback",
             "disable_additional_properties", "whitespace_pattern"}
    unknown = sorted(set(outputs) - known)
    if unknown:
        raise InvalidRequest(f"structured_outputs.{unknown[0]} is not supported", f"structured_outputs.{unknown[0]}")
    for kind in ("json", "regex", "choice", "grammar"):
        if outputs.get(kind) is not None:
            yield f"structured_outputs.{kind}", (kind, outputs[kind])
    if outputs.get("json_object"):
        yield "structured_outputs.json_object", ("json", ANY_OBJECT)


def _response_format(value: Any) -> tuple[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequest("response_format must be an object with a type", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json", ANY_OBJECT
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequest("response_format.json_schema must be an object whose schema is an object",
                                 "response_format.json_schema")
        return "json", spec.get("schema", ANY_OBJECT)
    raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got {kind[:40]!r}",
                         "response_format.type")


def _grammar(kind: str, value: Any, field: str) -> str:
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError:
                raise InvalidRequest(f"{field} is not valid JSON", field) from None
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{field} must be a JSON schema object", field)
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequest(f"{field} must be a non-empty list of non-empty strings", field)
        return LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in value))
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{field} must be a non-empty string", field)
    return LLMatcher.grammar_from_regex(value) if kind == "regex" else LLMatcher.grammar_from_lark(value)
