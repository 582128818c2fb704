"""Tool-call parsers (issue 52 item 1) on answers written in each family's markup: the content and calls of a whole
answer, and the same assembled from a stream cut anywhere (no markup in the content, a call's name before its
arguments); forced choices' answers; the thinking split off before the calls are read."""

from __future__ import annotations

import json

import pytest

from afd.config.sections import TOOL_CALL_PARSERS
from afd.server.api import answers
from afd.server.api.answers import AnswerReading, AnswerStream, whole_answer
from afd.server.api.reasoning import PARSERS as THINKING
from afd.server.api.tool_parsers import PARSERS, ToolCallStream, default_parser, parse
from afd.server.api.tools import ForcedCallStream, forced_calls, forced_schema, tools_of
from afd.engine.request import InvalidRequest
from tests.server.tool_call_texts import EXPECTED, STREAMED, TEXTS

CASES = [(parser, name, text) for parser, texts in TEXTS.items() for name, text in texts]


def test_every_parser_is_a_setting_value():
    assert tuple(PARSERS) == TOOL_CALL_PARSERS


@pytest.mark.parametrize("parser, name, text", CASES)
def test_a_whole_answer(parser, name, text):
    content, calls = parse(PARSERS[parser], text)
    assert (content, [(c.name, c.arguments) for c in calls]) == EXPECTED[parser, name]


def assembled(stream, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """What a client assembles: the content, and per call index its name (given once, first) and argument pieces."""
    content, calls = "", {}
    for piece in [*pieces, None]:
        text, deltas = stream.feed(piece) if piece is not None else stream.finish()
        content += text
        for delta in deltas:
            assert (delta.name is not None) == (delta.index not in calls), "the name first, once"
            calls.setdefault(delta.index, [delta.name, ""])[1] += delta.arguments
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("parser, name, text", CASES)
def test_a_streamed_answer_cut_anywhere_reads_the_same(parser, name, text):
    expected = STREAMED.get((parser, name), EXPECTED[parser, name])
    assert assembled(ToolCallStream(PARSERS[parser]), list(text)) == expected
    for at in range(len(text) + 1):
        assert assembled(ToolCallStream(PARSERS[parser]), [text[:at], text[at:]]) == expected, at


def test_content_never_shows_a_partial_opening():
    stream = ToolCallStream(PARSERS["deepseek_v31"])
    assert stream.feed("Let me check.<｜tool▁ca") == ("Let me check.", [])
    assert stream.feed("lls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{") == ("", [answers.CallDelta(0, "f", "{")])


def test_defaults_by_architecture():
    assert default_parser("qwen3_moe", "") == "qwen3"
    assert default_parser("deepseek_v3", "<｜tool▁sep｜>…```json") == "deepseek_v3"
    assert default_parser("deepseek_v3", "<｜tool▁sep｜>{{ arguments }}") == "deepseek_v31"
    assert default_parser("kimi_k2", "") == default_parser("deepseek_v3", "<|tool_call_begin|>") == "kimi_k2"
    assert default_parser("glm4_moe", "") is None


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time"}}]


def test_request_tools_are_checked():
    assert tools_of(None, None, None) is None and tools_of([], "auto", None) is None
    assert tools_of(TOOLS, None, None).choice == "auto"
    named = tools_of(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False)
    assert (named.named, named.forced, named.parallel) == ("get_time", True, False)
    for tools, choice in [(None, "required"), (TOOLS, {"type": "function", "function": {"name": "nope"}}),
                          ([{"type": "retrieval"}], None), (TOOLS, "sometimes")]:
        with pytest.raises(InvalidRequest):
            tools_of(tools, choice, None)


def test_required_is_an_array_of_named_objects():
    schema = forced_schema(tools_of(TOOLS, "required", False))
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [item["properties"]["name"] for item in schema["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                               {"const": "get_time"}]
    required = tools_of(TOOLS, "required", None)
    text = '[{"name": "get_weather", "parameters": {"city": "東京"}}, {"name": "get_time", "parameters": {}}, {"na'
    assert [(c.name, json.loads(c.arguments)) for c in forced_calls(required, text)] == [
        ("get_weather", {"city": "東京"}), ("get_time", {})]  # the whole objects of an answer cut short
    stream = ForcedCallStream(required)
    deltas = [d for piece in text for d in stream.feed(piece)]
    assert [(d.index, d.name, json.loads(d.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "東京"}), (1, "get_time", {})]


def test_a_named_choice_streams_its_arguments_as_they_come():
    named = tools_of(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    stream = ForcedCallStream(named)
    pieces = [stream.feed(p) for p in ['{"ci', 'ty": ', '"Paris"}']]
    assert pieces[0] == [answers.CallDelta(0, "get_weather", '{"ci')]
    assert "".join(d.arguments for p in pieces for d in p) == '{"city": "Paris"}'
    assert [(c.name, c.arguments) for c in forced_calls(named, '{"city": "Paris"}')] == [("get_weather", '{"city": "Paris"}')]


def test_calls_are_read_after_the_thinking():
    reading = AnswerReading(THINKING["deepseek_r1"], True, tools_of(TOOLS, "auto", None), PARSERS["deepseek_v3"])
    text = "Need the weather.</think>" + TEXTS["deepseek_v3"][0][1]
    reasoning, content, calls = whole_answer(reading, text)
    assert (reasoning, content, [c.name for c in calls]) == ("Need the weather.", None, ["get_weather"])
    stream, shown = AnswerStream(reading), []
    for piece in text:
        shown.append(stream.feed(piece))
    shown.append(stream.finish())
    assert "".join(r for r, _, _ in shown) == "Need the weather." and not "".join(c for _, c, _ in shown)
    assert [d.name for _, _, deltas in shown for d in deltas if d.name] == ["get_weather"]
    # a tool-call section ends Kimi's thinking and is read as calls
    kimi = AnswerReading(THINKING["kimi_k2"], True, tools_of(TOOLS, "auto", None), PARSERS["kimi_k2"])
    reasoning, content, calls = whole_answer(kimi, "Plan." + TEXTS["kimi_k2"][0][1])
    assert (reasoning, content, [c.name for c in calls]) == ("Plan.", None, ["get_weather"])


@pytest.mark.parametrize("choice, called, reason, streamed, expected", [
    ("auto", True, "stop", False, "tool_calls"), ("auto", True, "length", False, "tool_calls"),
    ("auto", True, "length", True, "length"), ("auto", False, "stop", False, "stop"),
    ("required", True, "stop", False, "tool_calls"), ("required", True, "length", False, "length"),
    ({"type": "function", "function": {"name": "get_time"}}, True, "stop", True, "stop"),  # OpenAI's, for a named one
])
def test_finish_reasons_as_vllm_gives_them(choice, called, reason, streamed, expected):
    reading = AnswerReading(tools=tools_of(TOOLS, choice, None), parser=PARSERS["qwen3"])
    assert answers.finish_reason(reading, called, reason, streamed) == expected


def test_parallel_tool_calls_false_keeps_the_first_call_of_auto():
    reading = AnswerReading(tools=tools_of(TOOLS, "auto", False), parser=PARSERS["qwen3"])
    text = dict(TEXTS["qwen3"])["parallel"]
    assert [c.name for c in whole_answer(reading, text)[2]] == ["get_weather"]
    stream = AnswerStream(reading)
    deltas = [d for piece in text for d in stream.feed(piece)[2]] + stream.finish()[2]
    assert {d.index for d in deltas} == {0}
