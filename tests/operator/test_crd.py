"""The CRD: structural, valid for Kubernetes, in step with the typed model, and its CEL
rules evaluated for real (cel-python) on good and bad resources."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel

from afd_operator.model.autoscaling import REPLICAS_MANAGED_MESSAGE as REPLICAS_MANAGED
from afd_operator.model.spec import AFDDeploymentSpec, SpecError, parse_spec
from op_testkit import (
    CEL_REFUSED, SAMPLES, SCHEMA_REFUSED, apply_defaults, cel_failures, crd_schema, make_cr, walk_validations,
)

NEWEST = kubernetes_validate.utils.latest_version()


@pytest.mark.parametrize("version", ["1.30", NEWEST])
def test_crd_is_a_valid_kubernetes_object(crd, version):
    kubernetes_validate.validate(crd, version, strict=True)


def test_crd_names_and_subresources(crd):
    spec = crd["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["kind"]) == ("afd.io", "Namespaced", "AFDDeployment")
    assert spec["names"]["plural"] == "afddeployments" and spec["names"]["shortNames"] == ["afd"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["storage"] and version["served"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Groups", "Topology", "Revision", "Age"]


def _structural_problems(node, path):
    if path != ".metadata" and "type" not in node and not node.get("x-kubernetes-int-or-string"):
        yield f"{path}: no type"
    if node.get("x-kubernetes-preserve-unknown-fields"):
        yield f"{path}: preserve-unknown-fields"
    if "properties" in node and "additionalProperties" in node:
        yield f"{path}: both properties and additionalProperties"
    for key, sub in (node.get("properties") or {}).items():
        yield from _structural_problems(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _structural_problems(node[key], f"{path}.{key}")


def test_schema_is_structural():
    assert list(_structural_problems(crd_schema(), "")) == []


def _model_problems(model: type[BaseModel], schema: dict, path: str):
    """Fields the typed model and the CRD schema disagree about (by name)."""
    props = schema.get("properties") or {}
    fields = {f.alias: f for f in model.model_fields.values()}
    for missing in sorted(set(fields) ^ set(props)):
        yield f"{path}.{missing}: only in {'the model' if missing in fields else 'the CRD'}"
    for alias, field in fields.items():
        sub_model = _model_of(field.annotation)
        if sub_model is not None and alias in props:
            sub_schema = props[alias]
            if sub_schema.get("type") == "array":
                sub_schema = sub_schema["items"]
            yield from _model_problems(sub_model, sub_schema, f"{path}.{alias}")


def _model_of(annotation):
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
        for inner in getattr(candidate, "__args__", ()):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def _bound_problems(model: type[BaseModel], schema: dict, path: str):
    """Integer fields whose minimum/maximum differ between the CRD and the typed model."""
    props = schema.get("properties") or {}
    for field in model.model_fields.values():
        sub = props.get(field.alias)
        if sub is None:
            continue
        sub_model = _model_of(field.annotation)
        if sub_model is not None:
            yield from _bound_problems(sub_model, sub.get("items", sub), f"{path}.{field.alias}")
        elif sub.get("type") == "integer" and "enum" not in sub:
            bounds = {"Ge": next((m.ge for m in field.metadata if hasattr(m, "ge")), None),
                      "Le": next((m.le for m in field.metadata if hasattr(m, "le")), None)}
            crd = (sub.get("minimum"), sub.get("maximum"))
            if crd != (bounds.get("Ge"), bounds.get("Le")):
                yield f"{path}.{field.alias}: CRD {crd}, model {(bounds.get('Ge'), bounds.get('Le'))}"


def test_typed_model_and_crd_schema_have_the_same_integer_bounds():
    """The CRD's maxima bound CEL cost estimates; the operator's own check must agree."""
    spec_schema = crd_schema()["properties"]["spec"]
    assert list(_bound_problems(AFDDeploymentSpec, spec_schema, "spec")) == []


def test_typed_model_and_crd_schema_have_the_same_fields():
    spec_schema = crd_schema()["properties"]["spec"]
    assert list(_model_problems(AFDDeploymentSpec, spec_schema, "spec")) == []


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_validate_against_the_crd_schema_and_cel_rules(path):
    body = yaml.safe_load(path.read_text())
    defaulted = apply_defaults(crd_schema(), body)
    jsonschema.Draft7Validator(crd_schema()).validate(defaulted)
    assert cel_failures(crd_schema(), defaulted) == []


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_crd_defaults_equal_the_typed_model_defaults(path):
    """What the API server stores (CRD defaults) parses to the same spec as the raw file."""
    body = yaml.safe_load(path.read_text())
    defaulted = apply_defaults(crd_schema(), body)
    assert parse_spec(defaulted["spec"]) == parse_spec(body["spec"])


def test_every_cel_rule_compiles():
    import celpy

    env = celpy.Environment()
    rules = list(walk_validations(crd_schema()))
    assert len(rules) >= 5
    for _, rule in rules:
        env.compile(rule["rule"])
        if "messageExpression" in rule:
            env.compile(rule["messageExpression"])


@pytest.mark.parametrize("name, change, message", CEL_REFUSED)
def test_cel_rules_reject_what_the_schema_cannot(name, change, message):
    body = make_cr(name=name, **change)
    defaulted = apply_defaults(crd_schema(), body)
    jsonschema.Draft7Validator(crd_schema()).validate(defaulted)  # the schema alone lets it through
    failures = cel_failures(crd_schema(), defaulted)
    assert len(failures) == 1 and message in failures[0]


@pytest.mark.parametrize("change", [
    {"attention": {"ranks": 2}, "ffn": {"ranks": 3}},
    {"rollout": {"maxSurge": 0, "maxUnavailable": 0}},
    {"restartPolicy": {"backoffSeconds": 60, "maxBackoffSeconds": 10}},
    {"podSecurity": {"runAsUser": 0}},
    {"ratio": {"minAttentionPerFFN": 4, "maxAttentionPerFFN": 2}},
    {"autoscaling": {"minGroups": 5, "maxGroups": 2}},
    {"autoscaling": {"enabled": True}},
])
def test_cel_and_the_operator_say_the_same_thing(change):
    """If the API server runs an older CRD, the operator's own check gives the same message."""
    defaulted = apply_defaults(crd_schema(), make_cr(**change))
    [cel_message] = cel_failures(crd_schema(), defaulted)
    with pytest.raises(SpecError) as err:
        parse_spec(defaulted["spec"])
    assert cel_message in str(err.value)


AUTOSCALED = {"autoscaling": {"enabled": True, "targets": {"ttftP90Seconds": 1.0}}}


@pytest.mark.parametrize("old, new, refused", [
    (AUTOSCALED, {**AUTOSCALED, "replicas": 3}, True),  # kubectl scale while autoscaling: refused
    (AUTOSCALED, AUTOSCALED, False),  # any other update keeps replicas: fine
    ({}, {**AUTOSCALED, "replicas": 3}, False),  # turning it on may set replicas in the same write
    (AUTOSCALED, {"replicas": 3}, False),  # turning it off may too
])
def test_replicas_cannot_change_while_autoscaling(old, new, refused):
    """A transition rule: on an update the API server refuses a replicas change (a /scale write
    included) while autoscaling stays on; creates never run it."""
    stored, updated = (apply_defaults(crd_schema(), make_cr(**change)) for change in (old, new))
    failures = cel_failures(crd_schema(), updated, stored)
    assert failures == ([REPLICAS_MANAGED] if refused else [])
    assert cel_failures(crd_schema(), updated) == []


@pytest.mark.parametrize("change, where", SCHEMA_REFUSED)
def test_schema_rejects_out_of_range_values(change, where):
    defaulted = apply_defaults(crd_schema(), make_cr(**change))
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.Draft7Validator(crd_schema()).validate(defaulted)
    assert where in "/".join(map(str, err.value.absolute_path))


def test_security_and_network_defaults_of_the_crd():
    """What a CR without these fields gets from the API server: non-root as the image's user,
    no NetworkPolicy."""
    spec = apply_defaults(crd_schema(), make_cr())["spec"]
    assert spec["podSecurity"] == {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001}
    assert spec["networkPolicy"] == {"enabled": False}
