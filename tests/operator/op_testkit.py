"""Helpers shared by the operator tests: the CRD, the samples, CR builders."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "afd.io_afddeployments.yaml"
SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden"


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def crd_schema() -> dict[str, Any]:
    return load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def make_cr(name: str = "demo", namespace: str = "ns", uid: str = "uid-demo", **spec: Any) -> dict[str, Any]:
    """A custom resource body as the API server would hold it (namespace and uid set)."""
    body: dict[str, Any] = {
        "image": "registry.example/afd-runtime:0.1.0",
        "model": {"uri": "pvc://models/tiny"},
        "attention": {"ranks": 2},
        "ffn": {"ranks": 1},
    }
    body.update(copy.deepcopy(spec))
    return {
        "apiVersion": "afd.io/v1alpha1",
        "kind": "AFDDeployment",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": 1},
        "spec": body,
    }


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Default a value the way the API server does for a structural schema: missing
    properties get their `default`, recursively, also inside defaulted values."""
    value = copy.deepcopy(value)
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                value[key] = apply_defaults(extra, value[key])
    elif schema.get("type") == "array" and isinstance(value, list):
        value = [apply_defaults(schema.get("items", {}), v) for v in value]
    return value


def walk_validations(schema: dict[str, Any], path: str = ""):
    """Yield (path, rule dict) for every x-kubernetes-validations rule in the schema."""
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, rule
    for key, sub in (schema.get("properties") or {}).items():
        yield from walk_validations(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from walk_validations(schema["items"], f"{path}[]")


def cel_failures(schema: dict[str, Any], obj: Any) -> list[str]:
    """Evaluate every CEL rule of `schema` on `obj` (already defaulted) with cel-python;
    return the messages of the rules that fail, as the API server would report them."""
    import celpy

    env = celpy.Environment()
    failures = []

    def visit(node_schema: dict[str, Any], node: Any) -> None:
        for rule in node_schema.get("x-kubernetes-validations") or []:
            activation = {"self": celpy.json_to_cel(node)}
            if not bool(env.program(env.compile(rule["rule"])).evaluate(activation)):
                if "messageExpression" in rule:
                    message = str(env.program(env.compile(rule["messageExpression"])).evaluate(activation))
                else:
                    message = rule.get("message", rule["rule"])
                failures.append(message)
        if isinstance(node, dict):
            for key, sub in (node_schema.get("properties") or {}).items():
                if key in node:
                    visit(sub, node[key])
        if isinstance(node, list) and isinstance(node_schema.get("items"), dict):
            for item in node:
                visit(node_schema["items"], item)

    visit(schema, obj)
    return failures
