"""Reasoning parsers (`reasoning_parser`): a model's thinking split from its answer, whole or as it streams.

Each family writes its thinking between `<think>` and `</think>`; they differ in who writes the opening tag:

- `deepseek_r1`: DeepSeek-R1's chat template ends the prompt with `<think>\\n` (R1-0528 and the updated R1), so the
  output starts inside the thinking, which ends at `</think>`; an opening tag the model writes itself (the first
  R1 release) is dropped. No `</think>` at all: everything is thinking.
- `qwen3`: Qwen3 writes `<think>…</think>` itself when thinking (`enable_thinking`, on by default); with
  `enable_thinking: false` its template ends the prompt with an empty `<think>\\n\\n</think>\\n\\n` and the output is
  all answer. A template that ends the prompt with `<think>` (Qwen3-2507 Thinking) starts the output inside it.
- `deepseek_v3`: DeepSeek-V3.1 thinks only when its template is rendered with `thinking: true`, which ends the prompt
  with `<think>`; rendered without, the prompt ends with `</think>` and the output is all answer.
- `kimi_k2`: Kimi-K2-Thinking thinks unless the request says `thinking: false` (`chat_template_kwargs`), starting
  inside the thinking or with its own `<think>`; a tool-call section (`<|tool_calls_section_begin|>`) also ends
  the thinking, and stays in the answer, where the tool calls are read.

So a split starts inside the thinking where the family always does (R1) or where the prompt's text ends with the
opening tag; otherwise an opening tag at the very start of the output opens it (R1, Qwen3). Once the thinking has
ended the rest is answer, tags included. Streamed, a piece of text that could be the start of a tag is held back
until the next piece says what it is, so no part of a tag ever reaches either field. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Family:
    """How one model family marks its thinking (see the module's docstring)."""

    always_open: bool  # the output starts inside the thinking, whatever the prompt
    leading_tag: bool  # an opening tag at the very start of the output opens the thinking
    off_switch: str = ""  # a template variable that, false, turns the thinking off (always_open then does not hold)
    answer_starts: tuple[str, ...] = ()  # markup that ends the thinking and belongs to the answer


PARSERS: dict[str, Family] = {
    "deepseek_r1": Family(always_open=True, leading_tag=True),
    "qwen3": Family(always_open=False, leading_tag=True),
    "deepseek_v3": Family(always_open=False, leading_tag=False),
    "kimi_k2": Family(always_open=True, leading_tag=True, off_switch="thinking",
                      answer_starts=("<|tool_calls_section_begin|>",)),
}


def grammar_after_thinking(grammar: str, family: Family, thinking: bool) -> str:
    """A structured-output grammar (llguidance's serialized form) that constrains the answer only, as vLLM does with a
    reasoning parser: free text up to `</think>` first where the output starts inside the thinking; where a family
    may open it itself (Qwen3), an optional `<think>…</think>` first; else `grammar` as it is."""
    optional = family.leading_tag and not family.always_open
    if not thinking and not optional:
        return grammar
    top = json.loads(grammar)
    answer = top["grammars"][0]
    answer["name"] = name = answer.get("name") or "answer"
    start = f"thinking @{name}" if thinking else f'@{name} | "{START}" thinking @{name}'
    rules = f"start: {start}\nthinking[lazy]: /(?s:.*){re.escape(END).replace('/', chr(92) + '/')}/\n"
    return json.dumps({**top, "grammars": [{"name": "after_thinking", "lark_grammar": rules}, *top["grammars"]]})


def opens_thinking(family: Family, prompt_tail: str, template_kwargs: dict | None = None) -> bool:
    """Whether the output of a prompt ending with `prompt_tail`, rendered with `template_kwargs`, starts inside the
    thinking."""
    if family.off_switch and (template_kwargs or {}).get(family.off_switch, True) is False:
        return False
    return family.always_open or prompt_tail.rstrip().endswith(START)


class ThinkingSplit:
    """One output's thinking and answer, fed as it streams: `feed(text)` and `finish()` return the (reasoning,
    content) text that can be shown now."""

    def __init__(self, family: Family, thinking: bool):
        self.family = family
        self.thinking = thinking  # inside the thinking now
        self.at_start = True  # nothing shown yet: a leading opening tag may come
        self.answering = False  # the thinking is over: the rest is answer, unparsed
        self.held = ""  # text that may be the start of a tag

    def feed(self, text: str) -> tuple[str, str]:
        if self.answering:
            return "", text
        self.held += text
        if self.at_start and self.family.leading_tag:
            if START.startswith(self.held):
                return "", ""  # so far only a (partial) opening tag: wait
            if self.held.startswith(START):
                self.held, self.thinking = self.held[len(START):], True
        self.at_start = False
        if not self.thinking:
            self.answering, content, self.held = True, self.held, ""
            return "", content
        ends = [(at, mark) for mark in (END, *self.family.answer_starts) if (at := self.held.find(mark)) >= 0]
        if ends:
            at, mark = min(ends)
            reasoning, after = self.held[:at], self.held[at + len(mark) if mark == END else at:]
            self.answering, self.held = True, ""
            return reasoning, after
        keep = max(_partial_tag(self.held, mark) for mark in (END, *self.family.answer_starts))
        reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held is shown as what it was inside of."""
        held, self.held = self.held, ""
        return (held, "") if self.thinking and not self.answering else ("", held)


def split(family: Family, thinking: bool, text: str) -> tuple[str | None, str | None]:
    """A whole output as (reasoning, content), each None where empty (vLLM's shape)."""
    parts = ThinkingSplit(family, thinking)
    reasoning, content = parts.feed(text)
    more_reasoning, more_content = parts.finish()
    return (reasoning + more_reasoning) or None, (content + more_content) or None


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is the start of `tag` (0: none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
