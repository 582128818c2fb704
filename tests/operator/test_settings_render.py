"""spec.afd and the runtime's settings (issue 36): defaults from the runtime's declarations, bounds no wider than
the runtime's, and every field reaches the pods (no field the renderer silently drops)."""

from __future__ import annotations

import typing

import annotated_types
import pytest
import yaml
from pydantic.alias_generators import to_camel

from afd.config import SETTINGS, load_config
from afd_operator.model.spec import AFDSettings, CudaGraphs, parse_owner, parse_spec
from afd_operator.rendering.children import render_all
from op_testkit import make_cr

# fields that only make sense together with another one (the vLLM attention image and its arguments)
CONTEXT = {"vllm_args": {"attentionEngine": "vllm"}, "attention_image": {"attentionEngine": "vllm"}}
# spec.afd fields whose default means something else than the runtime's: 0 API processes = the API in the engine
NOT_THE_RUNTIMES = {"api_servers"}


def _bounds(info):
    low = next((m.ge for m in info.metadata if isinstance(m, annotated_types.Ge)), None)
    high = next((m.le for m in info.metadata if isinstance(m, annotated_types.Le)), None)
    return low, high


def _other_value(name, info):
    """A valid value of spec.afd's field `name` that is not its default."""
    default = info.get_default(call_default_factory=True)
    kind = info.annotation
    if typing.get_origin(kind) is typing.Literal:
        return next(choice for choice in typing.get_args(kind) if choice != default)
    if kind is bool:
        return not default
    if kind is CudaGraphs:
        return {"enabled": not default.enabled}
    if kind == list[str]:
        return ["--enforce-eager"]
    if kind == typing.Optional[str]:
        return "registry.example/vllm:1"
    low, high = _bounds(info)
    value = default + 1 if kind is int else (default + (high if high is not None else default + 1)) / 2
    return value if high is None or value <= high else low


def _rendered(afd, tmp_path):
    """(the attention container, the config its runtime builds at rank 0 from what was rendered)."""
    body = make_cr(afd=afd)
    objs = render_all(parse_spec(body["spec"]), parse_owner(body))
    config_map = next(o for o in objs if o["kind"] == "ConfigMap")
    sts = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["labels"].get("afd.io/role") == "attention")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    path = tmp_path / "afd.yaml"
    path.write_text(config_map["data"]["afd.yaml"])
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env.update(HOSTNAME=f"{sts['metadata']['name']}-0", AFD_CONFIG_FILE=str(path))
    return container, load_config(env=env)


@pytest.mark.parametrize("name", sorted(AFDSettings.model_fields))
def test_every_spec_afd_field_reaches_the_pods(name, tmp_path):
    info = AFDSettings.model_fields[name]
    base = dict(CONTEXT.get(name, {}))
    changed = {**base, to_camel(name): _other_value(name, info)}
    before_container, before = _rendered(base, tmp_path)
    after_container, after = _rendered(changed, tmp_path)
    if name == "attention_image":  # not a runtime setting: the attention container's image
        assert after_container["image"] != before_container["image"]
    else:
        assert after != before, f"spec.afd.{to_camel(name)} changed nothing the runtime reads"
    if name in SETTINGS and name not in ("vllm_args", "cuda_graphs"):  # those two: a list, a nested switch
        assert getattr(after, name) == getattr(AFDSettings(**{name: changed[to_camel(name)]}), name)


@pytest.mark.parametrize("name", [n for n in AFDSettings.model_fields if n in SETTINGS and n not in NOT_THE_RUNTIMES])
def test_defaults_are_the_runtimes_and_bounds_no_wider(name):
    info, spec = AFDSettings.model_fields[name], SETTINGS[name]
    default = info.get_default(call_default_factory=True)
    if isinstance(default, CudaGraphs):
        default = default.enabled
    if name != "vllm_args":  # a list of arguments in the spec, one shell-quoted string in the runtime
        assert default == spec.default
    for bound in _bounds(info):
        if bound is not None:
            spec.check(bound)  # raises if the operator accepts a value the runtime refuses
    if typing.get_origin(info.annotation) is typing.Literal:
        assert set(typing.get_args(info.annotation)) <= set(spec.choices)


def test_the_config_map_carries_runtime_names_only():
    body = make_cr(afd={"dboMinTokens": 8, "kvCacheBytes": 1 << 30})
    config_map = next(o for o in render_all(parse_spec(body["spec"]), parse_owner(body)) if o["kind"] == "ConfigMap")
    runtime = yaml.safe_load(config_map["data"]["afd.yaml"])
    assert set(runtime) <= set(SETTINGS) and runtime["dbo_min_tokens"] == 8
