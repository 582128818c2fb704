"""Answers written in each family's tool-call markup (as its chat template writes calls), shared by the parser tests
and the parity tests against vLLM's parsers."""

from __future__ import annotations

B, E, C, CE, S = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KS, KE, KC, KA, KCE = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                       "<|tool_call_argument_begin|>", "<|tool_call_end|>")
MARKUP = [B, E, C, CE, S, KS, KE, KC, KA, KCE, "<tool_call>", "</tool_call>", "<think>", "</think>"]


def _v3(name: str, args: str) -> str:
    return f"{C}function{S}{name}\n```json\n{args}\n```{CE}"


def _v31(name: str, args: str) -> str:
    return f"{C}{name}{S}{args}{CE}"


def _kimi(name: str, args: str, index: int = 0) -> str:
    return f"{KC}functions.{name}:{index}{KA}{args}{KCE}"


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


PARIS, TIME = '{"city": "Paris"}', '{"tz": "CET", "hours": 24}'
TOKYO = '{"city": "東京"}'

# parser -> [(case name, answer)]
TEXTS: dict[str, list[tuple[str, str]]] = {
    "deepseek_v3": [
        ("single", B + _v3("get_weather", PARIS) + E),
        ("parallel", B + _v3("get_weather", PARIS) + "\n" + _v3("get_time", TIME) + E),
        ("after_text", "Let me check." + B + _v3("get_weather", TOKYO) + E),
        ("blank_before", "\n\n" + B + _v3("get_weather", PARIS) + E),
        ("no_calls", "It is sunny in Paris."),
        ("text_after", B + _v3("get_weather", PARIS) + E + "\nDone, it is sunny."),
        ("malformed", "Checking." + B + C + "function" + S + "get_weather\n{city: Paris" + CE + E),
        ("unclosed", "Checking." + B + C + "function" + S + "get_weather\n```json\n" + '{"city": "Pa'),
    ],
    "deepseek_v31": [
        ("single", B + _v31("get_weather", PARIS) + E),
        ("parallel", B + _v31("get_weather", PARIS) + _v31("get_time", TIME) + E),
        ("after_text", "Let me check." + B + _v31("get_weather", TOKYO) + E),
        ("blank_before", "\n" + B + _v31("get_weather", PARIS) + E),
        ("no_calls", "It is sunny in Paris."),
        ("text_after", B + _v31("get_weather", PARIS) + E + "\nDone, it is sunny."),
        ("malformed", "Checking." + B + C + "get_weather" + CE + E),
        ("unclosed", "Checking." + B + C + "get_weather" + S + '{"city": "Pa'),
    ],
    "kimi_k2": [
        ("single", KS + _kimi("get_weather", PARIS) + KE),
        ("parallel", KS + _kimi("get_weather", PARIS) + _kimi("get_time", TIME, 1) + KE),
        ("after_text", "Let me check." + KS + _kimi("get_weather", TOKYO) + KE),
        ("blank_before", "\n" + KS + _kimi("get_weather", PARIS) + KE),
        ("no_calls", "It is sunny in Paris."),
        ("text_after", KS + _kimi("get_weather", PARIS) + KE + "\nDone, it is sunny."),
        ("malformed", "Checking." + KS + KC + "get_weather" + KA + PARIS + KCE + KE),
        ("unclosed", "Checking." + KS + _kimi("get_weather", PARIS)[:-len(KCE)]),
        ("blank_arguments", KS + _kimi("get_weather", " " + PARIS + " \n") + _kimi("get_time", "", 1) + KE),
    ],
    "qwen3": [
        ("single", _hermes("get_weather", PARIS)),
        ("parallel", _hermes("get_weather", PARIS) + "\n" + _hermes("get_time", TIME)),
        ("after_text", "Let me check.\n" + _hermes("get_weather", TOKYO)),
        ("blank_before", "\n\n" + _hermes("get_weather", PARIS)),
        ("no_calls", "It is sunny in Paris."),
        ("text_after", _hermes("get_weather", PARIS) + "\nDone, it is sunny."),
        ("malformed", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),
        ("unclosed", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'),
    ],
}
VLLM_NAMES = {"qwen3": "hermes"}  # our parser -> vLLM's parser of that format, where the names differ

# (parser, case) -> what the whole answer reads as: (content, [(name, arguments)]) — vLLM's parsers give the same
_CITY, _BOTH = [("get_weather", PARIS)], [("get_weather", PARIS), ("get_time", TIME)]
EXPECTED = {
    **{(p, "single"): (None, _CITY) for p in TEXTS},
    **{(p, "parallel"): (None, _BOTH) for p in TEXTS},
    **{(p, "after_text"): ("Let me check.", [("get_weather", TOKYO)]) for p in ("deepseek_v3", "deepseek_v31", "kimi_k2")},
    ("qwen3", "after_text"): ("Let me check.\n", [("get_weather", TOKYO)]),
    **{(p, "blank_before"): (None, _CITY) for p in TEXTS},  # blanks before the calls are no content
    **{(p, "no_calls"): ("It is sunny in Paris.", []) for p in TEXTS},
    **{(p, "text_after"): (None, _CITY) for p in TEXTS},  # text after the calls is dropped
    # DeepSeek's and Kimi's: markup that does not read as a call is dropped, the text before it kept
    **{(p, "malformed"): ("Checking.", []) for p in ("deepseek_v3", "deepseek_v31", "kimi_k2")},
    ("qwen3", "malformed"): (dict(TEXTS["qwen3"])["malformed"], []),  # a call whose JSON does not read: all of it is content
    **{(p, "unclosed"): ("Checking.", []) for p in ("deepseek_v3", "deepseek_v31")},  # cut short: no call
    ("kimi_k2", "unclosed"): ("Checking.", _CITY),  # Kimi's and Qwen3's: a call cut short after its arguments counts
    ("qwen3", "unclosed"): ("Checking.\n", _CITY),
    ("kimi_k2", "blank_arguments"): (None, [("get_weather", PARIS), ("get_time", "{}")]),  # stripped; none: {}
}
# streamed, a call cut short shows what came of it before the end (its name and arguments so far, as vLLM's stream)
STREAMED = {(p, "unclosed"): ("Checking.", [("get_weather", '{"city": "Pa')]) for p in ("deepseek_v3", "deepseek_v31")}
