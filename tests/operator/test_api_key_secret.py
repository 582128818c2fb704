"""`spec.api.apiKeySecretRef` (issue 52 item 3): the CRD takes it (the key's name defaulted), the attention pods read
AFD_API_KEY from that Secret (env valueFrom), the FFN pods not at all, and no rendered object holds a key or a
literal AFD_API_KEY (the ConfigMap included)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from afd_operator.model.spec import parse_owner, parse_spec
from afd_operator.rendering.children import render_all
from op_testkit import apply_defaults, crd_schema, make_cr

REF = {"apiKeySecretRef": {"name": "clients", "key": "keys"}}


def _pod_envs(objects) -> dict[str, list[list[dict]]]:
    """Each StatefulSet's role → its containers' env lists."""
    found: dict[str, list[list[dict]]] = {}
    for obj in objects:
        if obj["kind"] == "StatefulSet":
            role = obj["spec"]["template"]["metadata"]["labels"]["afd.io/role"]
            found.setdefault(role, []).extend(c.get("env", []) for c in obj["spec"]["template"]["spec"]["containers"])
    return found


@pytest.mark.parametrize("engine", ["afd", "vllm"])
def test_attention_pods_read_the_api_key_from_the_secret_and_nothing_holds_it(engine):
    body = make_cr(api=REF, afd={"attentionEngine": engine, "attentionImage": "registry.example/afd-vllm:0.1.0"}
                   if engine == "vllm" else {})
    objects = render_all(parse_spec(body["spec"]), parse_owner(body))
    envs = _pod_envs(objects)
    for env in envs["attention"]:
        [key] = [e for e in env if e["name"] == "AFD_API_KEY"]
        assert key == {"name": "AFD_API_KEY", "valueFrom": {"secretKeyRef": {"name": "clients", "key": "keys"}}}
    assert not any(e["name"] == "AFD_API_KEY" for env in envs["ffn"] for e in env)
    text = json.dumps(objects)
    assert text.count("AFD_API_KEY") == len(envs["attention"]) and "api_key" not in text


def test_without_the_ref_no_pod_asks_for_a_key():
    body = make_cr()
    assert "AFD_API_KEY" not in json.dumps(render_all(parse_spec(body["spec"]), parse_owner(body)))


def test_the_crd_takes_the_ref_defaults_its_key_and_refuses_one_without_a_name():
    schema = crd_schema()
    defaulted = apply_defaults(schema, make_cr(api={"apiKeySecretRef": {"name": "clients"}}))
    jsonschema.Draft7Validator(schema).validate(defaulted)
    assert defaulted["spec"]["api"]["apiKeySecretRef"] == {"name": "clients", "key": "api-key"}
    assert parse_spec(defaulted["spec"]).api.api_key_secret_ref.key == "api-key"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(apply_defaults(schema, make_cr(api={"apiKeySecretRef": {"key": "k"}})))


@pytest.mark.parametrize("engine", ["afd", "vllm"])
def test_the_api_parsers_reach_the_attention_pods_only(engine):
    """`spec.api.toolCallParser` / `reasoningParser` (issue 52): the attention pods' AFD_TOOL_CALL_PARSER and
    AFD_REASONING_PARSER (the vLLM engine passes them on as its flags); unset, none; the CRD refuses unknown names."""
    api = {"toolCallParser": "kimi_k2", "reasoningParser": "kimi_k2"}
    body = make_cr(api=api, afd={"attentionEngine": engine, "attentionImage": "registry.example/afd-vllm:0.1.0"}
                   if engine == "vllm" else {})
    jsonschema.Draft7Validator(crd_schema()).validate(apply_defaults(crd_schema(), body))
    envs = _pod_envs(render_all(parse_spec(body["spec"]), parse_owner(body)))
    for env in envs["attention"]:
        assert {e["name"]: e["value"] for e in env if e["name"].endswith("_PARSER")} == {
            "AFD_TOOL_CALL_PARSER": "kimi_k2", "AFD_REASONING_PARSER": "kimi_k2"}
    assert not any(e["name"].endswith("_PARSER") for env in envs["ffn"] for e in env)
    plain = make_cr()
    assert "_PARSER" not in json.dumps(render_all(parse_spec(plain["spec"]), parse_owner(plain)))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(crd_schema()).validate(apply_defaults(crd_schema(), make_cr(api={"toolCallParser": "x"})))
