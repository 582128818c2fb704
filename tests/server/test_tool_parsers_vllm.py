"""Parity with vLLM (issue 52): each of our tool-call and reasoning parsers against vLLM's parser of the same name on the
same texts (`tool_call_texts`, the reasoning parsers' cases), run by vLLM's own chat-server parser stack in its venv
(`vllm_parsers_run.py`; `AFD_VLLM_PYTHON` or `.venv-vllm`; skipped where it is not installed): the whole answer's
content, calls and reasoning equal (call ids aside); our stream, cut at every character, assembles to what vLLM's whole
reading gives (vLLM's own stream is compared where it differs from its whole reading: a call cut short)."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

import pytest

from afd.server.api.answers import AnswerReading, AnswerStream, whole_answer
from afd.server.api.reasoning import PARSERS as THINKING, ThinkingSplit, split
from afd.server.api.tool_parsers import PARSERS, ToolCallStream, parse
from afd.server.api.tools import tools_of
from tests.server.test_reasoning_parsers import CASES as REASONING_CASES
from tests.server.test_tool_parsers import assembled
from tests.server.tool_call_texts import MARKUP, TEXTS, VLLM_NAMES
from tests.vllm_engine.test_vllm_parity import _vllm_env, vllm_python

pytestmark = pytest.mark.skipif(vllm_python() is None, reason="vLLM not installed: run scripts/install_vllm.sh")

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_weather", "get_time")]
THINKING_NAMES = {id(family): name for name, family in THINKING.items()}
# a reasoning parser and a tool-call parser together: the calls are read after the thinking
COMBINED = [("deepseek_r1", "deepseek_v3", True, "Need the weather.\n</think>\n\n" + TEXTS["deepseek_v3"][2][1]),
            ("deepseek_v3", "deepseek_v31", True, "Plan.</think>" + TEXTS["deepseek_v31"][1][1]),
            ("qwen3", "qwen3", False, "<think>\nCall it.\n</think>\n\n" + TEXTS["qwen3"][0][1]),
            ("kimi_k2", "kimi_k2", True, "Need it." + TEXTS["kimi_k2"][1][1])]


def _template_kwargs(parser: str, thinking: bool, text: str) -> dict | None:
    """What the request says, for vLLM's parsers that read it, where our split reads the prompt instead."""
    if parser == "deepseek_v3":
        return {"thinking": thinking}
    if parser == "kimi_k2":
        return None if thinking else {"thinking": False}
    if parser == "qwen3" and not thinking and not text.startswith("<think>"):
        return {"enable_thinking": False}
    return None


@functools.cache
def vllm_readings() -> dict:
    cases = [{"tool_parser": VLLM_NAMES.get(p, p), "text": text, "tools": TOOLS, "key": ["tool", p, name]}
             for p, texts in TEXTS.items() for name, text in texts]
    for index, (family, thinking, text, _) in enumerate(REASONING_CASES):
        name = THINKING_NAMES[id(family)]
        cases.append({"reasoning_parser": name, "text": text, "prompt": "hi<think>" if thinking else "hi",
                      "chat_template_kwargs": _template_kwargs(name, thinking, text), "key": ["reasoning", index]})
    for index, (reasoner, tools, thinking, text) in enumerate(COMBINED):
        cases.append({"reasoning_parser": reasoner, "tool_parser": VLLM_NAMES.get(tools, tools), "text": text,
                      "tools": TOOLS, "prompt": "hi<think>" if thinking else "hi",
                      "chat_template_kwargs": _template_kwargs(reasoner, thinking, text), "key": ["combined", index]})
    workdir = Path(__import__("tempfile").mkdtemp(prefix="vllm-parsers-"))
    (workdir / "job.json").write_text(json.dumps({"markup": MARKUP, "cases": cases}))
    run = subprocess.run([vllm_python(), str(Path(__file__).with_name("vllm_parsers_run.py")), str(workdir / "job.json"),
                          str(workdir / "out.json")], env=_vllm_env({}), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return {json.dumps(case["key"]): result for case, result in zip(cases, json.loads((workdir / "out.json").read_text()))}


def _vllm(*key) -> dict:
    return vllm_readings()[json.dumps(list(key))]


def _calls(calls) -> list[list[str]]:
    return [[name, arguments] for name, arguments, *_ in calls]


@pytest.mark.parametrize("parser, name, text", [(p, n, t) for p, texts in TEXTS.items() for n, t in texts])
def test_tool_calls_equal_vllms(parser, name, text):
    theirs = _vllm("tool", parser, name)
    content, calls = parse(PARSERS[parser], text)
    assert [None, content, [[c.name, c.arguments] for c in calls]] == theirs["whole"]
    # streamed: what vLLM reads of the whole answer, or where a call was cut short, what vLLM's stream shows
    reference = theirs["streamed"][0] if name == "unclosed" else theirs["whole"]
    expected = (reference[1], [tuple(call) for call in _calls(reference[2])])
    for at in range(len(text) + 1):
        assert assembled(ToolCallStream(PARSERS[parser]), [text[:at], text[at:]]) == expected, at
    assert assembled(ToolCallStream(PARSERS[parser]), list(text)) == expected


@pytest.mark.parametrize("index", range(len(REASONING_CASES)))
def test_reasoning_equals_vllms(index):
    family, thinking, text, _ = REASONING_CASES[index]
    theirs = _vllm("reasoning", index)
    assert list(split(family, thinking, text)) == theirs["whole"][:2]
    for at in range(len(text) + 1):
        parts = ThinkingSplit(family, thinking)
        shown = [parts.feed(text[:at]), parts.feed(text[at:]), parts.finish()]
        streamed = ["".join(r for r, _ in shown) or None, "".join(c for _, c in shown) or None]
        assert streamed == theirs["whole"][:2], at


@pytest.mark.parametrize("index", range(len(COMBINED)))
def test_reasoning_then_tool_calls_equal_vllms(index):
    reasoner, parser, thinking, text = COMBINED[index]
    reading = AnswerReading(THINKING[reasoner], thinking, tools_of(TOOLS, "auto", None), PARSERS[parser])
    theirs = _vllm("combined", index)
    reasoning, content, calls = whole_answer(reading, text)
    assert [reasoning, content, [[c.name, c.arguments] for c in calls]] == theirs["whole"]
    stream = AnswerStream(reading)
    shown = [stream.feed(piece) for piece in text] + [stream.finish()]
    names = [d.name for _, _, deltas in shown for d in deltas if d.name]
    assert ["".join(r for r, _, _ in shown) or None, "".join(c for _, c, _ in shown) or None] == theirs["whole"][:2]
    assert names == [name for name, _ in theirs["whole"][2]]
