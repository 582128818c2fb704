"""Helpers for the chart tests: render charts/afd-operator with Helm's own library
(helm-python-sdk) and split the output into objects."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterable

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "afd-operator"
RELEASE, NAMESPACE = "afd", "afd-system"
FULLNAME = f"{RELEASE}-afd-operator"

# Every optional feature on at once (namespaced RBAC, peering, metrics, monitors, dashboards).
ALL_FEATURES: dict[str, Any] = {
    "replicaCount": 2,
    "image": {"digest": "sha256:" + "ab" * 32, "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "operator": {"watchNamespaces": ["team-a", "team-b"], "peering": "afd", "resyncSeconds": 5,
                 "verbose": True, "extraArgs": ["--verbose"], "extraEnv": [{"name": "TZ", "value": "UTC"}]},
    "serviceAccount": {"annotations": {"iam.example/role": "afd"}},
    "podAnnotations": {"example/annotation": "x"},
    "podLabels": {"team": "ml"},
    "priorityClassName": "system-cluster-critical",
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
    "metrics": {"enabled": True, "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                "podMonitor": {"enabled": True, "interval": "15s"}},
    "dashboards": {"enabled": True, "namespace": "monitoring"},
    "networkPolicy": {"enabled": True,
                      "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                      "egress": [{"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
                                 {"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}], "ports": [{"protocol": "TCP", "port": 443}]}]},
}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "all-features": ALL_FEATURES,
    "cluster-wide-patterns": {"operator": {"watchNamespaces": ["team-*"]}, "rbac": {"clusterWide": True}},
    "minimal": {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "existing"},
                "crds": {"upgradeJob": {"enabled": False}}},
}


def load_chart(path: Path = CHART_DIR):
    import helm_python

    return helm_python.Chart.load(str(path))


def render(values: dict | None = None, path: Path = CHART_DIR, **kwargs: Any) -> dict[str, str]:
    """Template path → rendered text, as `helm template afd charts/afd-operator -n afd-system`."""
    chart = load_chart(path)
    try:
        return chart.render(copy.deepcopy(values) if values else None, name=RELEASE, namespace=NAMESPACE, **kwargs)
    finally:
        chart.close()


def objects(rendered: dict[str, str]) -> list[dict]:
    """Every Kubernetes object in the rendered templates (NOTES.txt excluded)."""
    out = []
    for name, text in sorted(rendered.items()):
        if name.endswith("NOTES.txt"):
            continue
        out += [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def render_objects(values: dict | None = None, **kwargs: Any) -> list[dict]:
    return objects(render(values, **kwargs))


def by_kind(objs: Iterable[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: Iterable[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def source_rbac() -> dict[str, list[dict]]:
    """ClusterRole name → rules, from the operator's own rbac.yaml."""
    docs = yaml.safe_load_all((ROOT / "operator" / "afd_operator" / "rbac.yaml").read_text())
    return {d["metadata"]["name"]: d["rules"] for d in docs if d}


def permissions(rules: Iterable[dict]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples granted by `rules`."""
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
