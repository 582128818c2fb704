"""A chat request's tools: `tools`, `tool_choice` and `parallel_tool_calls` checked, and what a forced choice asks of
the answer, as vLLM's OpenAI server does.

- `none`: the tools reach the template, the answer is text.
- `auto` (the default with tools): the model writes calls in its own markup, read by the `tool_call_parser`.
- a named function (`{"type": "function", "function": {"name": ...}}`): the answer is that function's arguments,
  JSON valid for its `parameters` schema (an llguidance grammar: whatever the weights); finish reason `stop`.
- `required`: the answer is a JSON array of one or more `{"name": ..., "parameters": {...}}` objects, each valid for
  its tool's schema (one object at most with `parallel_tool_calls: false`).

Pure: no I/O; the grammars are compiled by the caller.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from afd.engine.request import InvalidRequest
from afd.server.api.structured import JSON_OPTIONS
from afd.server.api.tool_parsers import Call, CallDelta

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Tools:
    """The request's functions (name → `parameters` schema), its choice (`none`, `auto`, `required` or a function's
    name) and whether several calls may come."""

    functions: dict[str, dict]
    choice: str
    parallel: bool = True

    @property
    def named(self) -> str | None:
        return None if self.choice in ("none", "auto", "required") else self.choice

    @property
    def forced(self) -> bool:
        """The answer is constrained to calls (`required` or a named function)."""
        return self.choice not in ("none", "auto")


def tools_of(tools: Any, choice: Any, parallel: Any) -> Tools | None:
    """The request's tools, or None where it has none (then `tool_choice` may only be `none` or `auto`)."""
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list of function tools", "tools")
    functions: dict[str, dict] = {}
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise InvalidRequest(f"{where}.function.name must be a string of 1 to 64 characters", f"{where}.function.name")
        parameters = function.get("parameters", ANY_OBJECT)
        if not isinstance(parameters, dict):
            raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
        functions[name] = parameters or ANY_OBJECT
    return Tools(functions, _choice(choice, functions), parallel is not False)


def _choice(choice: Any, functions: dict[str, dict]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise InvalidRequest(f"tool_choice names the function {str(name)[:64]!r}, which is not in tools",
                                 "tool_choice")
        return name
    raise InvalidRequest("tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
                         "tool_choice")


def forced_schema(tools: Tools) -> dict:
    """The JSON schema a forced choice's answer follows."""
    if tools.named is not None:
        return tools.functions[tools.named]
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                        "required": ["name", "parameters"], "additionalProperties": False}
                       for name, schema in tools.functions.items()]}
    return {"type": "array", "items": calls, "minItems": 1, **({} if tools.parallel else {"maxItems": 1})}


def forced_grammar(tools: Tools) -> str:
    """The llguidance grammar of a forced choice's answer; a schema it cannot take is the request's fault."""
    try:
        return LLMatcher.grammar_from_json_schema(forced_schema(tools), defaults=JSON_OPTIONS)
    except Exception as err:  # noqa: BLE001 - llguidance says what in the schema it does not take
        raise InvalidRequest(f"tools: a parameters schema cannot be enforced: {str(err)[:200]}", "tools") from None


def forced_calls(tools: Tools, text: str) -> list[Call]:
    """The calls of a forced choice's whole answer: a named function's (none where the answer is blank); `required`'s
    whole objects (those before an answer cut short)."""
    if tools.named is not None:
        return [Call(tools.named, text, True)] if text.strip() else []
    return [Call(item["name"], json.dumps(item["parameters"], ensure_ascii=False), True) for item in _whole_items(text)
            if isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item]


class ForcedCallStream:
    """A forced choice's calls as the answer streams: a named function's arguments go out as they come (its name
    first); `required`'s calls each once its object in the array is whole."""

    def __init__(self, tools: Tools):
        self.tools, self.text, self.sent, self.shown = tools, "", 0, 0

    def feed(self, text: str) -> list[CallDelta]:
        self.text += text
        if self.tools.named is not None:
            if not self.text.strip():
                return []  # a blank answer is no call
            piece, self.shown = self.text[self.shown:], len(self.text)
            if self.sent == 0:
                self.sent = 1
                return [CallDelta(0, self.tools.named, piece)]
            return [CallDelta(0, arguments=piece)] if piece else []
        whole = _whole_items(self.text)
        deltas = []
        for index, item in enumerate(whole[self.sent:], start=self.sent):
            if isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item:
                deltas.append(CallDelta(index, item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
        self.sent = len(whole)
        return deltas

    def finish(self) -> list[CallDelta]:
        return []

    @property
    def called(self) -> bool:
        return self.sent > 0


def _whole_items(text: str) -> list:
    """The whole items of the JSON array `text` begins, so far."""
    decoder, items = json.JSONDecoder(), []
    at = text.find("[")
    if at < 0:
        return items
    at += 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items
        items.append(item)
