"""The API boundary's pure checks: each bad value is refused with a 400 naming its field."""

import json
import math

import pytest

from afd.engine.request import InvalidRequest
from afd.server.api import json_body, validation
from afd.server.api.protocol import ChatRequest, CompletionRequest, parse_request
from afd.server.api.validation import Limits
from afd.server.front.metrics import FrontMetrics, merge_expositions

LIMITS = Limits(max_prompts=4, max_prompt_chars=100)


def refused(fn, *args):
    with pytest.raises(InvalidRequest) as caught:
        fn(*args)
    return caught.value


@pytest.mark.parametrize("raw, needle", [
    (b'{"model": "m", "prompt": "\xff"}', "not valid UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}", "nested too deeply"),
    (b"{not json", "not valid JSON"),
    (b'{"n": ' + b"9" * 5000 + b"}", "not valid JSON"),  # past Python's integer-digit limit
    (b'"a string"', "must be a JSON object"),
    (b'{"prompt": "a\\ud800b"}', "lone surrogate"),
    (b'{"x\\udfff": 1}', "lone surrogate"),
])
def test_bad_bodies_are_refused(raw, needle):
    assert needle in str(refused(json_body.parse_json_body, raw, 32))


def test_a_good_body_parses():
    assert json_body.parse_json_body(json.dumps({"prompt": ["é", "😀"], "n": [[1]]}).encode(), 32)["n"] == [[1]]


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.5), ("temperature", 1e300),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -math.inf), ("presence_penalty", math.nan),
    ("top_k", -2), ("top_k", 2**63), ("seed", 2**64), ("seed", -(2**63) - 1), ("n", 0), ("n", 10**6),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2**64), ("logprobs", 21), ("logprobs", -1),
    ("top_logprobs", 10**9),
])
def test_numbers_out_of_range_name_their_field(field, value):
    assert refused(validation.check_bounds, {field: value}).param == field


def test_numbers_in_range_pass():
    validation.check_bounds({"temperature": 0, "top_p": 1, "top_k": -1, "seed": 2**64 - 1, "max_tokens": 10**9,
                             "logprobs": 20, "n": 1, "top_logprobs": None})


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function"}]),
    ("best_of", 3), ("suffix", "tail"), ("tool_choice", "required"), ("whatever", 1),
])
def test_unsupported_fields_are_refused_by_name(field, value):
    error = refused(validation.refuse_unsupported, {field: value})
    assert error.param == field and field in str(error)


def test_neutral_values_of_unsupported_fields_pass():
    validation.refuse_unsupported({"tools": [], "best_of": 1,
                                   "suffix": None, "user": "alice", "tool_choice": "none"})


def test_prompts_are_counted_and_bounded():
    assert validation.completion_prompts("hi", LIMITS, 50, 64) == ["hi"]
    assert validation.completion_prompts([1, 2], LIMITS, 50, 64) == [[1, 2]]
    assert "at most 4" in str(refused(validation.completion_prompts, ["a"] * 5, LIMITS, 50, 64))
    assert "AFD_MAX_PROMPT_CHARS" in str(refused(validation.completion_prompts, "x" * 101, LIMITS, 50, 64))
    assert "maximum context length" in str(refused(validation.completion_prompts, [1] * 64, LIMITS, 50, 64))
    for bad in ([50], [-1], [1.5], [True], [], "", [["a"]], {"a": 1}, 7, ["a", [1]], "a\ud800"):
        assert refused(validation.completion_prompts, bad, LIMITS, 50, 64).param == "prompt"


def test_stop_strings_and_ids_are_bounded():
    assert validation.stop_strings("x", LIMITS) == ("x",)
    for bad in (["a"] * 65, ["x" * 1025], [""], [1], 3, ["\udc00"]):
        assert refused(validation.stop_strings, bad, LIMITS).param == "stop"
    for bad in ([-1], [50], [0] * 1025):
        assert refused(validation.stop_token_ids, bad, 50, LIMITS).param == "stop_token_ids"


def test_chat_text_parts_are_joined_and_media_refused():
    assert validation.chat_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "c") == "a\nb"
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    assert "text only" in str(refused(validation.chat_content, [image], "messages[0].content"))
    assert refused(validation.chat_content, [{"type": "input_audio"}], "m").param == "m[0]"
    for bad in ([{"type": "text"}], [{"type": "text", "text": 1}], [{"type": "weird"}], ["text"], 5,
                [{"type": "text", "text": "a", "extra": 1}]):
        refused(validation.chat_content, bad, "m")


def test_chat_messages_are_counted_and_bounded():
    ok = validation.chat_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], LIMITS)
    assert ok == [{"role": "user", "content": "hi"}]
    assert refused(validation.chat_messages, [{"role": "user", "content": "x"}] * 5000, LIMITS).param == "messages"
    assert "AFD_MAX_PROMPT_CHARS" in str(refused(validation.chat_messages, [{"role": "user", "content": "x" * 101}], LIMITS))
    assert "tool" in str(refused(validation.chat_messages, [{"role": "assistant", "tool_calls": [{"id": "1"}]}], LIMITS))


def test_request_models_refuse_wrong_types_by_field():
    for body, field in [({"model": "m", "prompt": "a", "temperature": "hot"}, "temperature"),
                        ({"model": "m", "prompt": "a", "temperature": True}, "temperature"),
                        ({"model": "m", "prompt": "a", "max_tokens": "3"}, "max_tokens"),
                        ({"model": "m", "prompt": "a", "max_tokens": 3.0}, "max_tokens"),
                        ({"model": 5, "prompt": "a"}, "model"),
                        ({"model": "m", "prompt": "a", "stream": "yes"}, "stream"),
                        ({"model": "m", "prompt": "a", "stream_options": {"bogus": 1}}, "stream_options.bogus"),
                        ({"model": "m", "prompt": "a", "logit_bias": {"1": "high"}}, "logit_bias.1"),
                        ({"model": "m", "prompt": "a", "min_tokens": 1.5}, "min_tokens"),
                        ({"model": "m", "prompt": "a", "bad_words": "x"}, "bad_words")]:
        assert refused(parse_request, CompletionRequest, body).param == field
    chat = {"model": "m", "messages": [{"role": "robot", "content": "x"}]}
    assert refused(parse_request, ChatRequest, chat).param == "messages[0].role"
    assert parse_request(CompletionRequest, {"model": "m", "prompt": "a", "temperature": 1}).temperature == 1.0


def test_a_huge_name_is_not_echoed_whole():
    assert len(validation.short("m" * 50_000_000)) < 200


def test_merged_metrics_keep_one_family_per_name_and_every_rank():
    rank = "# HELP afd_x_total d\n# TYPE afd_x_total counter\nafd_x_total{{rank=\"{0}\"}} {0}.0\n"
    merged = merge_expositions([rank.format(0), rank.format(1)]).decode()
    assert merged.count("# TYPE afd_x_total counter") == 1
    assert 'afd_x_total{rank="0"} 0.0' in merged and 'afd_x_total{rank="1"} 1.0' in merged
    front = FrontMetrics(lambda: 3, ["attention-0", "ffn-0"]).exposition({"attention-0": rank.format(0), "ffn-0": None})
    text = front.decode()
    assert 'afd_front_scrape_up{target="ffn-0"} 0.0' in text and 'afd_front_requests_total{status="5xx"} 0.0' in text
    assert "afd_front_requests_in_flight 3.0" in text and 'afd_x_total{rank="0"}' in text
