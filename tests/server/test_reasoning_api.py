"""Reasoning output through the chat API (issue 52 item 2): the app's real request path and formatting around an
engine that answers a known text in known pieces (a tiny model's text is random), so the split of `message`
and of the streamed deltas can be checked exactly; `chat_template_kwargs` reaches the template and says whether
the answer starts inside the thinking; an assistant message's reasoning sent back reaches the template."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry

from afd.engine.request import RequestOutput
from afd.engine.text.tokenizer import load_tokenizer
from afd.server.api.app import ServerState, create_app
from afd.server.api.reasoning import PARSERS

# renders `thinking` / `enable_thinking` the way DeepSeek-V3.1's and Qwen3's templates do, and sent-back reasoning
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.reasoning_content %} [thought: "
            "{{ m.reasoning_content }}]{% endif %}\n{% endfor %}assistant:{% if thinking is defined and thinking %}"
            "<think>{% elif enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% else %}</think>{% endif %}")


class ScriptedEngine:
    """Answers every request with `pieces` (one output each, the last finished), from another thread."""

    def __init__(self, pieces: list[str]):
        self.pieces, self.prompts, self.params = pieces, [], []

    def submit(self, prompt, params, on_output, **_):
        self.prompts.append(list(prompt))
        self.params.append(params)
        request_id = uuid.uuid4().hex

        def run():
            for index, piece in enumerate(self.pieces):
                last = index == len(self.pieces) - 1
                on_output(RequestOutput(request_id, piece, [7], [], finished=last, finish_reason="stop" if last else None,
                                        prompt_tokens=len(prompt), completion_tokens=index + 1))
        threading.Thread(target=run, daemon=True).start()
        return SimpleNamespace(request_id=request_id)

    @contextlib.contextmanager
    def together(self):
        yield

    def abort(self, request_id):
        pass


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    tokenizer = load_tokenizer(str(checkpoints["qwen3_moe"]))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _state(tokenizer, pieces, parser="deepseek_v3", reasoning_content=False) -> ServerState:
    return ServerState(engine=ScriptedEngine(pieces), tokenizer=tokenizer, model_name="m", max_model_len=4096,
                       vocab_size=len(tokenizer), health=lambda: None, registry=CollectorRegistry(),
                       reasoning=PARSERS.get(parser), reasoning_content=reasoning_content)


async def _post(state, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://rank") as client:
        return await client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 50, **body})


def _chat(state, stream=False, **body) -> dict | list[dict]:
    response = asyncio.run(_post(state, {"messages": [{"role": "user", "content": "Hi"}], "stream": stream, **body}))
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


PIECES = ["Plan", " the re", "ply.</th", "ink>Hel", "lo."]  # V3.1 in thinking mode: the template opened it


def test_a_thinking_answer_is_split_into_reasoning_and_content(tokenizer):
    state = _state(tokenizer, PIECES)
    message = _chat(state, chat_template_kwargs={"thinking": True})["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Hello.", "reasoning": "Plan the reply."}
    assert tokenizer.decode(state.engine.prompts[0]).endswith("assistant:<think>")  # the kwargs reached the template
    plain = _chat(state)["choices"][0]["message"]  # no thinking asked: the template closed it, all is answer
    assert plain == {"role": "assistant", "content": "Plan the reply.</think>Hello.", "reasoning": None}


def test_streamed_deltas_carry_the_reasoning_then_the_content_and_no_partial_tag(tokenizer):
    events = _chat(_state(tokenizer, PIECES, reasoning_content=True), stream=True, chat_template_kwargs={"thinking": True})
    deltas = [event["choices"][0]["delta"] for event in events]
    assert deltas == [
        {"role": "assistant", "reasoning": "Plan", "reasoning_content": "Plan"},
        {"reasoning": " the re", "reasoning_content": " the re"},
        {"reasoning": "ply.", "reasoning_content": "ply."},  # "</th" held back
        {"content": "Hel"},
        {"content": "lo."},
    ]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_qwen3_thinking_written_by_the_model_is_split_and_enable_thinking_false_reaches_the_template(tokenizer):
    state = _state(tokenizer, ["<thi", "nk>\n2+2=4\n</think>", "\n\nIt is 4."], parser="qwen3")
    message = _chat(state)["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("\n2+2=4\n", "\n\nIt is 4.")
    _chat(state, chat_template_kwargs={"enable_thinking": False})
    assert tokenizer.decode(state.engine.prompts[-1]).endswith("<think>\n\n</think>\n\n")


def test_an_assistant_message_sent_back_with_its_reasoning_reaches_the_template(tokenizer):
    state = _state(tokenizer, ["ok"])
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet."},
                {"role": "user", "content": "Again"}]
    _chat(state, messages=messages)
    assert "assistant: Hello. [thought: Greet.]" in tokenizer.decode(state.engine.prompts[-1])


def test_without_a_parser_the_thinking_stays_in_content_and_template_settings_are_checked(tokenizer):
    state = _state(tokenizer, PIECES, parser="")
    assert _chat(state)["choices"][0]["message"] == {"role": "assistant", "content": "Plan the reply.</think>Hello."}
    refused = asyncio.run(_post(state, {"messages": [{"role": "user", "content": "Hi"}],
                                        "chat_template_kwargs": {"tokenize": False}}))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


def test_each_choice_of_a_stream_has_its_own_split(tokenizer):
    events = _chat(_state(tokenizer, PIECES), stream=True, n=2, chat_template_kwargs={"thinking": True})
    for index in (0, 1):
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"][0]["index"] == index]
        assert "".join(d.get("reasoning") or "" for d in deltas) == "Plan the reply."
        assert "".join(d.get("content") or "" for d in deltas) == "Hello."


def test_a_moved_stream_goes_on_from_what_its_client_saw():
    """A stream moved from a lost rank: its split is first fed the text already sent, so a tag cut by the move
    (here "</th" sent before, "ink>" after) still ends the thinking."""
    from afd.server.api.answers import AnswerReading
    from afd.server.api.app import _answer_streams

    decoded = {(1, 2): "Plan the reply.</th"}
    state = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids: decoded[tuple(ids)]))
    answer = _answer_streams(state, AnswerReading(PARSERS["deepseek_r1"], True), SimpleNamespace(choices=[(1, 2)]))(0)
    assert answer.feed("ink>Hello.") == ("", "Hello.", [])
    assert _answer_streams(state, AnswerReading(), None) is None


def _accepts(grammars, grammar: str, tokenizer, text: str) -> bool:
    matcher = grammars.matcher(grammar)
    ids = tokenizer.encode(text)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_structured_output_constrains_the_answer_after_the_thinking(tokenizer):
    """As vLLM with a reasoning parser: the thinking is free, the answer follows the schema."""
    from afd.engine.structured_output.grammars import Grammars

    grammars = Grammars(tokenizer, len(tokenizer), ())
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    asked = {"response_format": schema, "chat_template_kwargs": {"thinking": True}}
    state = _state(tokenizer, ['{"a": 1}'], parser="deepseek_v3")
    _chat(state, **asked)
    thinking_first = state.engine.params[-1].grammar
    assert _accepts(grammars, thinking_first, tokenizer, 'Free {"b": text}.</think>{"a":1}')
    assert not _accepts(grammars, thinking_first, tokenizer, 'Free.</think>{"b":1}')
    assert not _accepts(grammars, thinking_first, tokenizer, '{"a":1}')  # the thinking must end first
    _chat(state, response_format=schema)  # V3.1 without thinking: the schema from the first token
    assert _accepts(grammars, state.engine.params[-1].grammar, tokenizer, '{"a":1}')
    qwen = _state(tokenizer, ['{"a": 1}'], parser="qwen3")
    _chat(qwen, response_format=schema)  # Qwen3 may think first, or not
    optional = qwen.engine.params[-1].grammar
    assert _accepts(grammars, optional, tokenizer, '<think>hmm</think>{"a":1}')
    assert _accepts(grammars, optional, tokenizer, '{"a":1}')
    assert not _accepts(grammars, optional, tokenizer, 'hmm{"a":1}')
