"""Structured outputs (llguidance): with the random-weight tiny model every completion parses and validates."""

import json

import httpx
import jsonschema
import pytest

from afd.engine.request import InvalidRequest
from afd.server.api.structured import grammar_of

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}


def post(server, path, **body):
    body.setdefault("model", server.model)
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def test_50_json_schema_completions_parse_and_validate(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    texts = []
    for seed in range(50):
        response = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "A person?"}],
                        response_format=fmt, max_tokens=120, temperature=1.0, seed=seed)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        texts.append(choice["message"]["content"])
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 10  # sampled, not one fixed answer


def test_json_object_parses_on_completions_and_chat(server):
    # A random model writes strings of random characters; a bias on '"' ends them sooner (and is masked where the
    # grammar does not allow a quote), so every answer finishes within max_tokens.
    quote = server.state.tokenizer.convert_tokens_to_ids('"')
    texts = []
    for seed in range(8):
        body = dict(response_format={"type": "json_object"}, max_tokens=300, temperature=1.0, seed=seed,
                    logit_bias={str(quote): 4})
        if seed % 2:
            choice = post(server, "/v1/completions", prompt="JSON:", **body).json()["choices"][0]
            texts.append(choice["text"])
        else:
            choice = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "JSON?"}],
                          **body).json()["choices"][0]
            texts.append(choice["message"]["content"])
        assert choice["finish_reason"] == "stop", choice
    assert all(isinstance(json.loads(text), dict) for text in texts)
    assert any(len(json.loads(text)) for text in texts)  # not only {}


def test_vllm_guided_forms(server):
    choice = post(server, "/v1/completions", prompt="Pick:", guided_choice=["yes", "no", "maybe"], max_tokens=8,
                  temperature=1.0, seed=1).json()["choices"][0]
    assert choice["text"] in {"yes", "no", "maybe"}
    regex = post(server, "/v1/completions", prompt="Number:", guided_regex="[0-9]{3}-[a-c]{2}", max_tokens=12,
                 temperature=1.0, seed=2).json()["choices"][0]["text"]
    assert len(regex) == 6 and regex[:3].isdigit() and regex[3] == "-" and set(regex[4:]) <= set("abc")
    current = post(server, "/v1/completions", prompt="JSON:", structured_outputs={"json": SCHEMA}, max_tokens=120,
                   temperature=0.8, seed=3).json()["choices"][0]["text"]
    jsonschema.validate(json.loads(current), SCHEMA)
    legacy = post(server, "/v1/completions", prompt="JSON:", guided_json=json.dumps(SCHEMA), max_tokens=120,
                  temperature=0.8, seed=4).json()["choices"][0]["text"]
    jsonschema.validate(json.loads(legacy), SCHEMA)


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, "response_format.json_schema"),
    ({"guided_regex": "(abc"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"bogus": 1}}, "structured_outputs.bogus"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, field):
    response = post(server, "/v1/completions", prompt="Hi", max_tokens=4, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_text_format_is_no_constraint_and_tools_are_for_chat_only(server):
    assert grammar_of({"response_format": {"type": "text"}}) is None
    with pytest.raises(InvalidRequest):
        grammar_of({"response_format": "json"})
    tools = [{"type": "function", "function": {"name": "f"}}]
    response = post(server, "/v1/completions", prompt="Hi", max_tokens=2, tools=tools)
    assert response.status_code == 400 and "tool calling is not supported" in response.json()["error"]["message"]
    response = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                    tools=tools, tool_choice="none")  # issue 52: chat takes tools
    assert response.status_code == 200, response.text


def test_masks_unpack_on_the_device_and_a_failed_matcher_allows_only_eos(server):
    import torch

    from afd.engine.structured_output.grammars import consume
    from afd.engine.structured_output.step_mask import StepMask, fill_bitmask

    grammars = server.engine.grammars
    vocab, eos = grammars.vocab_size, sorted(server.engine.eos_token_ids)
    digits = grammars.matcher(grammar_of({"guided_regex": "[0-9]+"})[0])
    failed = grammars.matcher(grammar_of({"guided_regex": "[0-9]+"})[0])
    letter = server.state.tokenizer.convert_tokens_to_ids("a")
    failed.consume_token(letter)  # not allowed: the matcher fails
    assert failed.is_error()
    logits = torch.zeros(3, vocab)
    masked = StepMask([0, 2], fill_bitmask([digits, failed], vocab, eos), logits.device).apply(logits.clone())
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in masked]
    texts = {server.state.tokenizer.decode([t]) for t in allowed[0]}
    assert texts and all(text.isdigit() for text in texts)
    assert allowed[1] == list(range(vocab)) and allowed[2] == eos
    consume(digits, allowed[0][0])
    consume(failed, letter)  # a failed matcher is left alone
    assert digits.is_accepting() and failed.is_error()


def test_an_api_process_checks_grammars_itself(server):
    """Where the engine is in another process (`AFD_API_PROCESS`), the API compiles the grammar on its own cache, so a
    bad one is still a 400 naming the field, not a failure in the engine core."""
    from dataclasses import replace

    from afd.server.api.app import _grammar
    from afd.server.api.protocol import CompletionRequest, parse_request

    state = replace(server.state, engine=object())  # an engine client: no grammars of its own
    good = parse_request(CompletionRequest, {"model": "m", "prompt": "a", "guided_regex": "[ab]+"})
    assert _grammar(state, good) and state.grammars is not None
    bad = parse_request(CompletionRequest, {"model": "m", "prompt": "a", "guided_regex": "[ab"})
    with pytest.raises(InvalidRequest) as caught:
        _grammar(state, bad)
    assert caught.value.param == "guided_regex"
