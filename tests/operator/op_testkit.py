"""Helpers shared by the operator tests: the CRD, the samples, CR builders."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from afd_operator.model import labels as L
from afd_operator.apiserver import KubeError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import check_crd  # noqa: E402  (scripts/ is not a package)

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


class FakeStore:
    """A `Store` that records what the reconciler did."""

    def __init__(self):
        self.applied, self.deleted, self.statuses, self.events = [], [], [], []
        self.objects, self.patches = {}, []

    def apply(self, obj):
        self.applied.append((obj["kind"], obj["metadata"]["name"], obj["metadata"]["labels"].get(L.REVISION)))

    def get(self, api_version, kind, namespace, name):
        return self.objects.get((kind, namespace, name))

    def create(self, obj):
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.objects:
            raise KubeError(409, "exists")
        self.objects[key] = obj

    def patch(self, api_version, kind, namespace, name, patch):
        self.patches.append((kind, name, patch))

    def delete(self, api_version, kind, namespace, name):
        self.deleted.append((kind, name))
        return True

    def patch_status(self, namespace, name, status):
        self.statuses.append(status)

    def post_event(self, owner, type, reason, message):
        self.events.append((type, reason, message))


# One definition of defaulting and CEL evaluation, shared with the CI guard (scripts/check_crd.py).
apply_defaults = check_crd.apply_defaults
walk_validations = check_crd.walk_validations
cel_failures = check_crd.cel_failures
evaluate_cel = check_crd.evaluate


# Custom resources the CRD refuses: (metadata.name, spec change, words of the refusal). Each is
# refused offline (jsonschema + cel-python, tests/operator/test_crd.py) and by a real API server
# (tests/operator/test_real_apiserver_crd.py).
CEL_REFUSED = [
    ("demo", {"attention": {"ranks": 2}, "ffn": {"ranks": 3}},
     "ffn.ranks (3) must not exceed attention.ranks (2)"),
    ("demo", {"rollout": {"maxSurge": 0, "maxUnavailable": 0}},
     "rollout.maxSurge and rollout.maxUnavailable must not both be 0"),
    ("demo", {"restartPolicy": {"backoffSeconds": 60, "maxBackoffSeconds": 10}},
     "restartPolicy.maxBackoffSeconds (10) must not be below restartPolicy.backoffSeconds (60)"),
    ("demo", {"ports": {"data": 25500}}, "ports.control, ports.data and ports.metrics"),
    ("demo", {"ports": {"http": 9090}}, "ports.http and ports.metrics"),
    ("n" * 41, {}, "metadata.name may have at most 40 characters"),
    ("demo", {"podSecurity": {"runAsUser": 0}}, "podSecurity.runAsUser must not be 0 (root)"),
    ("demo", {"afd": {"attentionEngine": "vllm", "connector": "nccl"}},
     "afd.attentionEngine=vllm needs afd.connector=zmq"),
    ("demo", {"ratio": {"minAttentionPerFFN": 4, "maxAttentionPerFFN": 2}},
     "ratio.minAttentionPerFFN must not exceed ratio.maxAttentionPerFFN"),
    ("demo", {"autoscaling": {"minGroups": 5, "maxGroups": 2}},
     "autoscaling.minGroups must not exceed autoscaling.maxGroups (5 > 2)"),
    ("demo", {"autoscaling": {"enabled": True}}, "autoscaling.enabled needs at least one target"),
]

# Refused by the OpenAPI schema alone: (spec change, the field named in the refusal).
SCHEMA_REFUSED = [
    ({"afd": {"stages": 3}}, "stages"), ({"afd": {"connector": "tcp"}}, "connector"),
    ({"afd": {"prefillItlRatio": -1}}, "prefillItlRatio"),
    ({"afd": {"apiServers": 17}}, "apiServers"),
    ({"ffn": {"ranks": 0}}, "ranks"), ({"ports": {"http": 70000}}, "http"), ({"ffn": {"expertParallel": 65}}, "expertParallel"),
    ({"model": {"uri": "s3://x/y"}}, "uri"), ({"replicas": -1}, "replicas"),
    ({"podSecurity": {"fsGroup": -1}}, "fsGroup"), ({"networkPolicy": {"enabled": "yes"}}, "enabled"),
    ({"networkPolicy": {"metricsNamespaceSelector": {"matchLabels": {"a": 1}}}}, "matchLabels"),
    ({"restartPolicy": {"maxBackoffSeconds": 86401}}, "maxBackoffSeconds"),
    ({"rollout": {"maxSurge": 101}}, "maxSurge"),
    ({"podSecurity": {"runAsUser": 2**31}}, "runAsUser"),
    ({"ratio": {"mode": "On"}}, "mode"), ({"ratio": {"maxAttentionPerFFN": 0.5}}, "maxAttentionPerFFN"),
    ({"ratio": {"cooldownSeconds": 604801}}, "cooldownSeconds"), ({"ratio": {"prometheusURL": "ftp://x"}}, "prometheusURL"),
    ({"autoscaling": {"maxGroups": 101}}, "maxGroups"), ({"autoscaling": {"targets": {"kvCacheUsage": 1.5}}}, "kvCacheUsage"),
    # JSON integer 0: a real API server lets it past `minimum: 0.001` (it truncates the minimum); a CEL rule refuses it
    ({"autoscaling": {"targets": {"ttftP90Seconds": 0}}}, "ttftP90Seconds"),
    ({"autoscaling": {"targets": {"kvCacheUsage": 0}}}, "kvCacheUsage"),
    ({"autoscaling": {"scaleDownMarginPercent": 95}}, "scaleDownMarginPercent"),
]
