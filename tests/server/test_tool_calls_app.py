"""Tool calls through the chat API's real request path (issue 52 item 1), around an engine that answers a known text
in known pieces (a tiny model's text is random): `auto` reads the calls of each of `n` choices, whole and streamed
(no markup in the content, usage counted once), `none` leaves the text as it is, the tools and the calls sent back
reach the template, and a stream moved from a lost rank goes on from what its client saw."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from afd.engine.text.tokenizer import load_tokenizer
from afd.server.api.answers import AnswerReading
from afd.server.api.app import ServerState, _answer_streams
from afd.server.api.tool_parsers import PARSERS
from afd.server.api.tools import tools_of
from tests.server.test_reasoning_api import ScriptedEngine, _chat

TEMPLATE = ("{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %} "
            "[call {{ c.id }} {{ c.function.name }}({{ c.function.arguments }})]{% endfor %}"
            "{% if m.tool_call_id %} [result of {{ m.tool_call_id }}]{% endif %}\n{% endfor %}assistant:")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PIECES = ["Let me check.\n<tool", "_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Paris\"}}\n</tool",
          "_call>"]


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    tokenizer = load_tokenizer(str(checkpoints["qwen3_moe"]))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _state(tokenizer, pieces=PIECES) -> ServerState:
    return ServerState(engine=ScriptedEngine(pieces), tokenizer=tokenizer, model_name="m", max_model_len=4096,
                       vocab_size=len(tokenizer), health=lambda: None, registry=CollectorRegistry(),
                       tool_parser=PARSERS["qwen3"])


def test_auto_reads_each_choices_calls_and_counts_usage_once(tokenizer):
    state = _state(tokenizer)
    reply = _chat(state, tools=TOOLS, n=2)
    ids = set()
    for choice in reply["choices"]:
        message = choice["message"]
        assert message["content"] == "Let me check.\n" and choice["finish_reason"] == "tool_calls"
        [call] = message["tool_calls"]
        assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        ids.add(call["id"])
    assert len(ids) == 2
    assert reply["usage"]["completion_tokens"] == 2 * len(PIECES)
    assert reply["usage"]["prompt_tokens"] == len(state.engine.prompts[0])
    assert state.engine.params[0].skip_special_tokens is False  # markup that is special tokens stays in the text
    rendered = tokenizer.decode(state.engine.prompts[0])
    assert rendered.startswith("tools: get_weather ")  # the tools reached the template


def test_streamed_calls_come_as_vllm_sends_them_for_each_choice(tokenizer):
    events = _chat(_state(tokenizer), stream=True, tools=TOOLS, n=2, stream_options={"include_usage": True})
    for index in (0, 1):
        choices = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        deltas = [c["delta"] for c in choices]
        assert "".join(d.get("content") or "" for d in deltas) == "Let me check.\n"  # no part of the markup
        calls = [call for d in deltas for call in d.get("tool_calls", [])]
        assert calls[0]["index"] == 0 and calls[0]["id"] and calls[0]["function"]["name"] == "get_weather"
        assert all("id" not in call for call in calls[1:])
        assert "".join(call["function"]["arguments"] for call in calls) == '{"city": "Paris"}'
        assert choices[-1]["finish_reason"] == "tool_calls"
    assert events[-1]["usage"]["completion_tokens"] == 2 * len(PIECES)


def test_none_leaves_the_answer_as_text(tokenizer):
    message = _chat(_state(tokenizer), tools=TOOLS, tool_choice="none")["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "".join(PIECES)}


def test_a_call_and_its_result_sent_back_reach_the_template(tokenizer):
    state = _state(tokenizer, ["It is sunny."])
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = _chat(state, tools=TOOLS, messages=messages)
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    rendered = tokenizer.decode(state.engine.prompts[0])
    assert '[call call_1 get_weather({"city": "Paris"})]' in rendered and "tool: sunny [result of call_1]" in rendered


def test_a_moved_stream_goes_on_from_what_its_client_saw():
    """The new rank's reading is first fed the text already sent (a whole call and the start of the next markup):
    the first call is not sent again, the next comes as index 1."""
    decoded = {(1, 2): "Let me check.\n" + CALL + "\n<tool_ca"}
    state = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids: decoded[tuple(ids)]))
    reading = AnswerReading(tools=tools_of(TOOLS, "auto", None), parser=PARSERS["qwen3"])
    answer = _answer_streams(state, reading, SimpleNamespace(choices=[(1, 2)]))(0)
    reasoning, content, deltas = answer.feed('ll>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>')
    assert (reasoning, content) == ("", "")
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(1, "get_weather", '{"city": "Tokyo"}')]
    assert answer.called
