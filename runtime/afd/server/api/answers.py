"""One chat choice's answer read as vLLM's chat server reads it: the thinking split off first (`reasoning`), then the
calls read from the rest — by the model family's markup (`tool_parsers`, `tool_choice: auto`) or as the JSON a forced
choice constrained it to (`tools`). Whole (`whole_answer`) or as it streams (`AnswerStream`). Pure: no I/O."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from afd.server.api import tool_parsers
from afd.server.api.reasoning import Family as ThinkingFamily, ThinkingSplit, split
from afd.server.api.tool_parsers import Call, CallDelta, ToolCallStream
from afd.server.api.tools import ForcedCallStream, Tools, forced_calls


@dataclass(frozen=True)
class AnswerReading:
    """How a request's answers are read: `thinking_family` (the reasoning parser) and whether the answer starts
    inside the thinking; `tools` (None: no tools, or `none`) and the `parser` of the model's own markup."""

    thinking_family: ThinkingFamily | None = None
    thinking: bool = False
    tools: Tools | None = None
    parser: tool_parsers.Family | None = None

    @property
    def reads_calls(self) -> bool:
        return self.tools is not None and (self.tools.forced or self.parser is not None)


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def whole_answer(reading: AnswerReading, text: str) -> tuple[str | None, str | None, list[Call]]:
    """A whole answer as (reasoning, content, calls); content None where empty (vLLM's shape)."""
    reasoning, content = (None, text or None) if reading.thinking_family is None else \
        split(reading.thinking_family, reading.thinking, text)
    if not reading.reads_calls:
        return reasoning, content, []
    if reading.tools.forced:
        return reasoning, None, forced_calls(reading.tools, content or "")
    content, calls = tool_parsers.parse(reading.parser, content or "")
    return reasoning, content, calls if reading.tools.parallel else calls[:1]  # vLLM keeps the first


def finish_reason(reading: AnswerReading, called: bool, reason: str | None, streamed: bool) -> str | None:
    """OpenAI's: `tool_calls` where calls came (`auto`, `required`), `stop` for a named function's."""
    if not called or reading.tools is None or reading.tools.named is not None:
        return reason
    if streamed or reading.tools.forced:
        return "tool_calls" if reason == "stop" else reason
    return "tool_calls"


class AnswerStream:
    """One choice's (reasoning, content, call pieces) as its text streams: `feed(text)`, `finish()`."""

    def __init__(self, reading: AnswerReading):
        self.reading = reading
        self.thinking = ThinkingSplit(reading.thinking_family, reading.thinking) if reading.thinking_family else None
        if not reading.reads_calls:
            self.calls = None
        elif reading.tools.forced:
            self.calls = ForcedCallStream(reading.tools)
        else:
            self.calls = ToolCallStream(reading.parser)
        self.ids: dict[int, str] = {}  # each call's id, given with its name

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    def feed(self, text: str) -> tuple[str, str, list[CallDelta]]:
        reasoning, answer = self.thinking.feed(text) if self.thinking else ("", text)
        return (reasoning, *self._answer(answer, False))

    def finish(self) -> tuple[str, str, list[CallDelta]]:
        reasoning, answer = self.thinking.finish() if self.thinking else ("", "")
        return (reasoning, *self._answer(answer, True))

    def _answer(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        if self.calls is None:
            return text, []
        if isinstance(self.calls, ForcedCallStream):
            deltas = self.calls.feed(text) + (self.calls.finish() if final else [])
            return "", deltas
        content, deltas = self.calls.feed(text)
        if final:
            more, later = self.calls.finish()
            content, deltas = content + more, deltas + later
        if not self.reading.tools.parallel:  # `parallel_tool_calls: false`: the first call only, as vLLM
            deltas = [delta for delta in deltas if delta.index == 0]
        return content, deltas

    def tool_calls(self, deltas: list[CallDelta]) -> list[dict]:
        """The pieces as OpenAI's `delta.tool_calls`: index, id, type and name first, then arguments."""
        shown = []
        for delta in deltas:
            if delta.name is not None:
                self.ids[delta.index] = call_id()
                shown.append({"index": delta.index, "id": self.ids[delta.index], "type": "function",
                              "function": {"name": delta.name, "arguments": delta.arguments}})
            else:
                shown.append({"index": delta.index, "function": {"arguments": delta.arguments}})
        return shown
