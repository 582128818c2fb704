"""Tool calls (issue 52 item 1) with the `openai` client against `afd up` (a tiny Qwen3-MoE, CPU, one deployment for
the module): forced choices give calls whose arguments follow their schemas whatever the weights, whole and streamed;
`none` and `auto` answer; a conversation holding a call and its result is rendered; a tool loop completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import httpx
import jsonschema
import pytest

from tests.server.test_up import read_state, wait_for

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["CET", "JST"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(checkpoints, tmp_path_factory):
    import openai

    from afd.local.children import free_port_block

    port = free_port_block(1)
    state_file = tmp_path_factory.mktemp("tools") / "state.json"
    args = [sys.executable, "-m", "afd", "up", "--model", str(checkpoints["qwen3_moe"]), "--topology", "1A1F",
            "--stages", "1", "--port", str(port), "--state-file", str(state_file), "--no-demo"]
    process = subprocess.Popen(args, env={**os.environ, "AFD_TEST_MARKER": uuid.uuid4().hex},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        state = wait_for(lambda: read_state(state_file), 240, "the state file")
        wait_for(lambda: _healthy(f"http://127.0.0.1:{port}/health"), 60, "the front door")
        yield openai.OpenAI(base_url=state["api"], api_key="unused", max_retries=0)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _create(client, **fields):
    fields = {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 80, **fields}
    return client.chat.completions.create(model=client.models.list().data[0].id, **fields)


def _assert_valid(calls) -> None:
    assert calls and len({call.id for call in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(stream):
    """Calls assembled from the deltas as a client does: by index, the id and name first, then argument pieces."""
    calls, ids, finish = {}, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.id:
                    assert delta.index not in ids, "one id per call"
                    ids[delta.index] = delta.id
                    assert delta.function.name, "the name comes with the id"
                call["name"] += (delta.function.name or "") if delta.id else ""
                call["arguments"] += delta.function.arguments or ""
    assert set(ids) == set(calls)
    return calls, finish


def test_a_named_tool_choice_calls_it_with_valid_arguments(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = _create(client, tool_choice=choice)
    _assert_valid(reply.choices[0].message.tool_calls)
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_weather"]
    assert reply.choices[0].finish_reason == "stop"  # OpenAI's for a named function
    calls, _ = _streamed_calls(_create(client, tool_choice=choice, stream=True))
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_calls_with_valid_arguments(client, parallel):
    reply = _create(client, tool_choice="required", parallel_tool_calls=parallel)
    calls = reply.choices[0].message.tool_calls
    _assert_valid(calls)
    assert parallel or len(calls) == 1
    streamed, finish = _streamed_calls(_create(client, tool_choice="required", parallel_tool_calls=parallel,
                                               stream=True))
    assert streamed and finish in ("tool_calls", "length")
    for call in streamed.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("tool_choice", ["none", "auto"])
def test_none_and_auto_answer(client, tool_choice):
    reply = _create(client, tool_choice=tool_choice, max_tokens=5)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.completion_tokens >= 1


def test_a_tool_loop_completes_with_the_call_and_its_result_rendered(client, checkpoints):
    from transformers import AutoTokenizer

    first = _create(client, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    result = {"forecast": "sunny"}
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
    answer = _create(client, messages=messages, tool_choice="auto", max_tokens=8)
    assert answer.choices[0].message.content is not None or answer.choices[0].message.tool_calls
    # the call (in Qwen3's <tool_call> markup) and its result reached the template: the prompt counts them
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["qwen3_moe"])
    rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert f'"name": "{call.function.name}"' in rendered and f"[{call.id}]" in rendered and "sunny" in rendered
    assert answer.usage.prompt_tokens == len(tokenizer.encode(rendered))
