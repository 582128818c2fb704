"""Reasoning parsers (issue 52 item 2): each family's output, written in its documented format, split into thinking
and answer, whole and streamed in pieces cut at every position (no part of a tag in either field)."""

from __future__ import annotations

import pytest

from afd.config.sections import REASONING_PARSERS
from afd.server.api.reasoning import PARSERS, ThinkingSplit, opens_thinking, split

R1, QWEN3, V31, KIMI = (PARSERS[name] for name in ("deepseek_r1", "qwen3", "deepseek_v3", "kimi_k2"))
KIMI_CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
             '{"city": "Tokyo"}<|tool_call_end|><|tool_calls_section_end|>')

# (family, output starts inside the thinking, output, expected (reasoning, content))
CASES = [
    # R1-0528: the template ends the prompt with "<think>\n"; the model writes the rest of it
    (R1, True, "The user greets me.\n</think>\n\nHello!", ("The user greets me.\n", "\n\nHello!")),
    # the first R1 release writes the opening tag itself
    (R1, True, "<think>\nSmall talk.\n</think>\n\nHi.", ("\nSmall talk.\n", "\n\nHi.")),
    (R1, True, "Still thinking when max_tokens ran out", ("Still thinking when max_tokens ran out", None)),
    (R1, True, "Done.</think>", ("Done.", None)),
    (R1, True, "<think>x</think>a <think> b </think>", ("x", "a <think> b </think>")),  # after the end: answer
    # Qwen3 with enable_thinking (its default): the model writes both tags
    (QWEN3, False, "<think>\nLet me add: 2+2=4.\n</think>\n\nIt is 4.", ("\nLet me add: 2+2=4.\n", "\n\nIt is 4.")),
    (QWEN3, False, "It is 4.", (None, "It is 4.")),  # enable_thinking false: the template closed an empty one
    (QWEN3, False, "<thinking> is a word", (None, "<thinking> is a word")),
    (QWEN3, False, "<thi", (None, "<thi")),  # ended on a partial tag: answer text
    (QWEN3, True, "reason</think>answer", ("reason", "answer")),  # a template that opened it (2507 Thinking)
    # DeepSeek-V3.1: the template ends the prompt with "<think>" in thinking mode, "</think>" otherwise
    (V31, True, "Plan the reply.</think>Hello.", ("Plan the reply.", "Hello.")),
    (V31, False, "Hello.", (None, "Hello.")),
    (V31, False, "<think>not a tag here</think>", (None, "<think>not a tag here</think>")),
    # Kimi-K2-Thinking: thinking by default; a tool-call section ends it and stays in the answer
    (KIMI, True, "<think>Sunny, say so.</think>It is sunny.", ("Sunny, say so.", "It is sunny.")),
    (KIMI, True, "Need the weather." + KIMI_CALL, ("Need the weather.", KIMI_CALL)),
    (KIMI, True, "Plan.</think>Calling." + KIMI_CALL, ("Plan.", "Calling." + KIMI_CALL)),
    (KIMI, False, "It is sunny.", (None, "It is sunny.")),  # thinking: false
]


def test_every_parser_is_a_setting_value():
    assert tuple(PARSERS) == REASONING_PARSERS


@pytest.mark.parametrize("family, thinking, text, expected", CASES)
def test_a_whole_output_is_split(family, thinking, text, expected):
    assert split(family, thinking, text) == expected


def _streamed(family, thinking: bool, pieces: list[str]) -> tuple[list[str], list[str]]:
    parts = ThinkingSplit(family, thinking)
    shown = [parts.feed(piece) for piece in pieces] + [parts.finish()]
    return [r for r, _ in shown], [c for _, c in shown]


@pytest.mark.parametrize("family, thinking, text, expected", CASES)
def test_a_streamed_output_cut_anywhere_gives_the_same_split_and_no_partial_tag(family, thinking, text, expected):
    cuts = [(i, j) for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    for i, j in cuts:  # three pieces: every pair of cut positions
        # pieces only ever add to a field: any part of a tag shown would stay in the joined fields
        reasoning, content = _streamed(family, thinking, [text[:i], text[i:j], text[j:]])
        assert ("".join(reasoning) or None, "".join(content) or None) == expected, (i, j)


def test_text_is_shown_as_soon_as_it_cannot_be_a_tag():
    parts = ThinkingSplit(R1, True)
    assert parts.feed("Thinking about <") == ("Thinking about ", "")  # "<" may start "</think>": held
    assert parts.feed("b>bold") == ("<b>bold", "")
    assert parts.feed("</thi") == ("", "")
    assert parts.feed("nk>\n\nAnswer") == ("", "\n\nAnswer")
    assert parts.feed(" goes on") == ("", " goes on")
    qwen = ThinkingSplit(QWEN3, False)
    assert qwen.feed("<") == ("", "") and qwen.feed("think>") == ("", "") and qwen.feed("a") == ("a", "")


def test_the_prompt_says_whether_the_thinking_is_open():
    assert opens_thinking(R1, "<｜Assistant｜>")  # R1 always starts inside (its template opens it)
    assert opens_thinking(V31, "<｜Assistant｜><think>") and not opens_thinking(V31, "<｜Assistant｜></think>")
    assert opens_thinking(QWEN3, "<|im_start|>assistant\n<think>\n")
    assert not opens_thinking(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking(QWEN3, "<|im_start|>assistant\n")
    assert opens_thinking(KIMI, "<|im_assistant|>assistant<|im_middle|>")  # on unless switched off
    assert not opens_thinking(KIMI, "<|im_assistant|>assistant<|im_middle|>", {"thinking": False})
    assert opens_thinking(R1, "", {"thinking": False})  # R1 has no switch: its template always opens it
