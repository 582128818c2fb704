"""Tool-call parsers (`tool_call_parser`, `tool_choice: auto`): the calls a model writes in its own markup, read from
its answer, whole or as it streams. Each family's markup, as its chat template writes the calls it is shown:

- `deepseek_v3` (DeepSeek-V3, R1): `<｜tool▁calls▁begin｜>` then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` newline, the arguments in a ```json fence on one line, and
  `<｜tool▁call▁end｜>`; `<｜tool▁calls▁end｜>` closes the section.
- `deepseek_v31` (DeepSeek-V3.1, R1-0528): the same section, each call `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS
  <｜tool▁call▁end｜>` (no type, no fence).
- `kimi_k2` (Kimi-K2): `<|tool_calls_section_begin|>`, per call `<|tool_call_begin|>functions.NAME:INDEX
  <|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>`, then `<|tool_calls_section_end|>`; the name is what
  stands between `functions.` and `:INDEX`.
- `qwen3` (Qwen3, the Hermes form): per call `<tool_call>` newline `{"name": NAME, "arguments": {...}}` newline
  `</tool_call>`; a call whose JSON does not read leaves the whole answer as content.

What the reading gives is what vLLM's parser of the same name gives on the same text (tests/server/
test_tool_parsers_vllm.py): the text before the first call is the content (None where empty or only blank), the
arguments are the model's own text (Qwen3's: its JSON written again), and whatever follows the section is dropped.
Streamed, the content goes out as it comes, less any end that could start the section's opening markup; a call's
name goes out once it is whole, then its arguments in pieces, less any end that could start the markup closing
them. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI_SECTION, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
HERMES_CALL, HERMES_CALL_END = "<tool_call>", "</tool_call>"


@dataclass
class Call:
    """One call as read so far: `name` None until it is whole; `arguments` the text read so far; `done` once its
    closing markup came."""

    name: str | None
    arguments: str = ""
    done: bool = False


def _partial(text: str, mark: str) -> int:
    """The length of the longest end of `text` that is the start of `mark` (0: none)."""
    for size in range(min(len(mark) - 1, len(text)), 0, -1):
        if text.endswith(mark[:size]):
            return size
    return 0


def _held_back(text: str, *marks: str) -> str:
    """`text` less any end that could start one of `marks`."""
    return text[:len(text) - max(_partial(text, mark) for mark in marks)]


class Family:
    """One markup: `opening` starts the tool section; `calls(section, final)` reads the calls in the text after it
    (`final`: the output ended, so an unclosed call is read as it stands)."""

    opening: str = ""

    def calls(self, section: str, final: bool) -> list[Call] | None:
        """The calls read from `section` (the text after `opening`), or None where the markup does not read as calls
        (the whole answer is then content)."""
        raise NotImplementedError


class DeepSeekV3(Family):
    opening = DS_CALLS
    # one call: type, name on its line, the arguments on one line in a json fence (vLLM's reading: no newline inside)
    _CALL = re.compile(re.escape(DS_CALL) + r"(?P<type>[^\n]*)" + re.escape(DS_SEP) +
                       r"(?P<name>[^\n]*)\n```json\n(?P<args>[^\n]*)\n```" + re.escape(DS_CALL_END))
    _HEAD = re.compile(re.escape(DS_CALL) + r"[^\n]*" + re.escape(DS_SEP) + r"(?P<name>[^\n]*)\n```json\n")
    _CLOSE = "\n```" + DS_CALL_END

    def calls(self, section: str, final: bool) -> list[Call]:
        found = [Call(m["name"], m["args"], True) for m in self._CALL.finditer(section)]
        rest = section[_end_of_last(self._CALL, section):]
        head = self._HEAD.search(rest)
        if head and not final and "\n" not in rest[head.end():].split(self._CLOSE)[0]:
            found.append(Call(head["name"], _held_back(rest[head.end():], self._CLOSE)))
        return found


class DeepSeekV31(Family):
    opening = DS_CALLS
    _CALL = re.compile(re.escape(DS_CALL) + r"(?P<name>[^\n]*?)" + re.escape(DS_SEP) + r"(?P<args>[^\n]*?)" +
                       re.escape(DS_CALL_END))
    _HEAD = re.compile(re.escape(DS_CALL) + r"(?P<name>[^\n]*?)" + re.escape(DS_SEP))

    def calls(self, section: str, final: bool) -> list[Call]:
        found = [Call(m["name"], m["args"], True) for m in self._CALL.finditer(section)]
        rest = section[_end_of_last(self._CALL, section):]
        head = self._HEAD.search(rest)
        if head and not final and "\n" not in rest[head.end():]:
            found.append(Call(head["name"], _held_back(rest[head.end():], DS_CALL_END)))
        return found


class KimiK2(Family):
    opening = KIMI_SECTION
    _ID = re.compile(r"(?P<id>.+:\d+)")

    def calls(self, section: str, final: bool) -> list[Call]:
        section = section.split(KIMI_SECTION_END)[0]
        found = []
        for part in section.split(KIMI_CALL)[1:]:
            header, has_args, rest = part.partition(KIMI_ARGS)
            if not has_args:
                continue  # the name is not whole until the arguments begin
            match = self._ID.match(header.strip())
            if not match:
                continue
            name = match["id"].strip().split(":")[0].removeprefix("functions.")
            arguments, done, _ = rest.partition(KIMI_CALL_END)
            if done or final:
                found.append(Call(name, arguments.strip() or "{}", True))
            else:
                # blanks at either end are not the arguments' (vLLM strips them): held until more comes
                found.append(Call(name, _held_back(arguments.lstrip(), KIMI_CALL_END, KIMI_SECTION_END).rstrip()))
        return found


class Hermes(Family):
    opening = HERMES_CALL

    def calls(self, section: str, final: bool) -> list[Call] | None:
        parts = (HERMES_CALL + section).split(HERMES_CALL)[1:]
        found = []
        for at, part in enumerate(parts):
            body, closed, _ = part.partition(HERMES_CALL_END)
            if not closed and not final:
                break  # a call is read once it is whole
            if not closed and at < len(parts) - 1:
                body = part  # vLLM's reading: an unclosed call runs to the end
            try:
                call = json.loads(body)
                found.append(Call(call["name"], json.dumps(call["arguments"], ensure_ascii=False), True))
            except Exception:  # noqa: BLE001 - any shape but {"name", "arguments"} is not a call
                if final:
                    return None
                break
        return found


PARSERS: dict[str, Family] = {
    "deepseek_v3": DeepSeekV3(),
    "deepseek_v31": DeepSeekV31(),
    "kimi_k2": KimiK2(),
    "qwen3": Hermes(),
}


DEFAULTS = {"kimi_k2": "kimi_k2", "qwen3_moe": "qwen3", "qwen3": "qwen3", "deepseek_v3": "deepseek_v3"}


def default_parser(model_type: str | None, chat_template: str | None) -> str | None:
    """The parser of a checkpoint's architecture (`model_type`), or None: DeepSeek-V3's is `deepseek_v31` where its chat
    template writes calls without the ```json fence (V3.1, R1-0528), and `kimi_k2` where it writes Kimi's markup."""
    template = chat_template or ""
    if KIMI_CALL in template:
        return "kimi_k2"
    name = DEFAULTS.get(model_type or "")
    if name == "deepseek_v3" and DS_SEP in template and "```json" not in template:
        return "deepseek_v31"
    return name


def chosen(setting: str, model_type: str | None, chat_template: str | None) -> Family | None:
    """The parser `tool_call_parser` names; empty: the architecture's (`default_parser`); `none`: None."""
    if setting == "none":
        return None
    return PARSERS.get(setting or default_parser(model_type, chat_template) or "")


def _end_of_last(pattern: re.Pattern, text: str) -> int:
    end = 0
    for match in pattern.finditer(text):
        end = match.end()
    return end


def parse(family: Family, text: str) -> tuple[str | None, list[Call]]:
    """A whole answer as (content, calls): no calls where it has none (content: the text as it is)."""
    at = text.find(family.opening)
    if at < 0:
        return text or None, []
    calls = family.calls(text[at + len(family.opening):], final=True)
    if calls is None:
        return text or None, []
    content = text[:at]
    return content if content.strip() else None, calls


@dataclass
class CallDelta:
    """A piece of one streamed call: its `index`; `name` on its first piece only, then `arguments` in pieces."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCallStream:
    """One answer's content and calls, fed as it streams: `feed(text)` and `finish()` return the (content, call
    pieces) that can be shown now."""

    family: Family
    text: str = ""
    shown: int = 0  # characters of content shown
    calls: list[Call] = field(default_factory=list)  # calls as shown: names and arguments sent
    blank: bool = True  # only blanks shown so far (held: they are dropped if calls follow)

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.text += text
        return self._show(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self._show(final=True)

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def _show(self, final: bool) -> tuple[str, list[CallDelta]]:
        at = self.text.find(self.family.opening)
        if at < 0:
            end = len(self.text) if final else len(_held_back(self.text, self.family.opening))
            return self._content(end, final), []
        calls = self.family.calls(self.text[at + len(self.family.opening):], final)
        if calls is None:
            return self._content(len(self.text), True), []  # not calls after all: everything is content
        content = self._content(at, False) if not calls else self._drop_blanks(at)
        return content, self._deltas(calls)

    def _content(self, end: int, final: bool) -> str:
        """Content up to `end`; only blanks so far are held until something else (or the end) comes."""
        if end <= self.shown:
            return ""
        piece = self.text[self.shown:end]
        if self.blank and not piece.strip() and not final:
            return ""
        self.shown, self.blank = end, False
        return piece

    def _drop_blanks(self, at: int) -> str:
        """Calls came: content before them is shown unless it is only blanks."""
        if self.blank and not self.text[:at].strip():
            self.shown = at
            return ""
        return self._content(at, True)

    def _deltas(self, calls: list[Call]) -> list[CallDelta]:
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index == len(self.calls):
                self.calls.append(Call(call.name))
                deltas.append(CallDelta(index, call.name))
            sent = self.calls[index]
            if call.arguments.startswith(sent.arguments) and len(call.arguments) > len(sent.arguments):
                piece = call.arguments[len(sent.arguments):]
                sent.arguments = call.arguments
                if deltas and deltas[-1].index == index and not deltas[-1].arguments:
                    deltas[-1].arguments = piece
                else:
                    deltas.append(CallDelta(index, arguments=piece))
        return deltas
