"""The Helm chart charts/afd-operator: lint, render, Kubernetes schemas, values schema, security.

Rendered with Helm's own library (helm-python-sdk), validated offline with kubernetes-validate.
"""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml

from chartkit import (
    ALL_FEATURES, CHART_DIR, FULLNAME, NAMESPACE, VALUE_SETS, by_kind, one, render, render_objects,
)

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) is not installed")

NEWEST = kubernetes_validate.utils.latest_version()
K8S_VERSIONS = ["1.30.0", NEWEST]
# Kinds from other projects' CRDs: kubernetes-validate has no schema for them (checked below by hand).
FOREIGN_KINDS = {"ServiceMonitor", "PodMonitor"}


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_helm_lint_is_clean(values):
    report = helm_python.lint(str(CHART_DIR), values or None, strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2 and m["error"] != "icon is recommended"]
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_rendered_object_passes_kubernetes_validate_strict(values, version):
    objs = render_objects(values)
    assert objs
    for obj in objs:
        if obj["kind"] in FOREIGN_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {version}: {err.message} "
                        f"at {'.'.join(map(str, err.path))}")


def test_default_install_is_operator_rbac_and_crd_hook_only():
    objs = render_objects()
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == sorted([
        ("Deployment", FULLNAME), ("ServiceAccount", FULLNAME),
        ("ClusterRole", FULLNAME), ("ClusterRoleBinding", FULLNAME),
        ("ServiceAccount", f"{FULLNAME}-crd-upgrade"), ("ClusterRole", f"{FULLNAME}-crd-upgrade"),
        ("ClusterRoleBinding", f"{FULLNAME}-crd-upgrade"), ("ConfigMap", f"{FULLNAME}-crd-upgrade"),
        ("Job", f"{FULLNAME}-crd-upgrade"),
    ])
    # The chart never creates role pods or their StatefulSets: the operator renders those.
    assert not {"StatefulSet", "Pod", "AFDDeployment"} & {o["kind"] for o in objs}


def test_operator_pod_is_locked_down_and_probed_on_kopfs_health_endpoint():
    deploy = one(render_objects(), "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert pod["serviceAccountName"] == FULLNAME
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["health"]
    assert f"--liveness=http://0.0.0.0:{port}/healthz" in container["args"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]  # the only writable path
    assert container["image"] == "registry.example/afd-operator:0.1.0"  # tag defaults to appVersion


def _operator_call(args: list[str], monkeypatch) -> dict:
    """Parse `args` with the operator's real CLI (afd_operator.cli.operator_main), capturing the run."""
    from afd_operator import cli

    seen = {}
    monkeypatch.setattr(cli, "run_operator", lambda *a, **kw: seen.update(args=a, kwargs=kw))
    assert cli.operator_main(args) == 0
    return seen


@pytest.mark.parametrize("values", [{}, {"operator": {"watchNamespaces": ["a", "b"], "peering": "afd", "verbose": True},
                                         "replicaCount": 2}], ids=["default", "namespaced-peering"])
def test_rendered_flags_are_accepted_by_the_operator_cli(values, monkeypatch):
    container = one(render_objects(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    call = _operator_call(container["args"], monkeypatch)
    namespaces, peering, liveness, resync = call["args"]
    assert liveness == "http://0.0.0.0:8080/healthz" and resync == 10.0
    assert list(namespaces) == values.get("operator", {}).get("watchNamespaces", [])
    assert peering == (values.get("operator", {}).get("peering") or None)


def test_metrics_flag_is_accepted_by_the_operator(monkeypatch):
    container = one(render_objects({"metrics": {"enabled": True}}), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "--metrics-port=9090" in container["args"]
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    call = _operator_call(container["args"], monkeypatch)
    assert call["kwargs"]["metrics_port"] == 9090
    assert _operator_call(one(render_objects(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"],
                          monkeypatch)["kwargs"]["metrics_port"] is None  # off unless metrics.enabled


def test_monitors_scrape_the_operators_metrics_port():
    objs = render_objects(ALL_FEATURES)
    selector = one(objs, "Deployment")["spec"]["selector"]["matchLabels"]
    service = one(objs, "Service", f"{FULLNAME}-metrics")
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    assert selector.items() <= service["spec"]["selector"].items()
    smon = one(objs, "ServiceMonitor")
    assert smon["apiVersion"] == "monitoring.coreos.com/v1" and smon["metadata"]["labels"]["release"] == "kps"
    assert smon["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    # honorLabels (issue 35): the series' own `namespace` (the AFDDeployment's) is kept, not renamed
    assert smon["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "honorLabels": True, "interval": "30s"}]
    pmon = one(objs, "PodMonitor")
    assert pmon["spec"]["selector"]["matchLabels"] == selector
    assert pmon["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics", "honorLabels": True,
                                                    "interval": "15s"}]
    assert not by_kind(render_objects({"metrics": {"enabled": True}}), "PodMonitor")  # opt-in


def test_the_operators_network_policy_is_opt_in_and_admits_only_metrics_scrapes():
    """Issue 35: with networkPolicy.enabled, nothing reaches the operator pod but scrapes of its
    metrics port from `metricsFrom` (default: the release namespace); egress is restricted only
    when rules are given. The CRD upgrade hook's pod is not selected."""
    assert not by_kind(render_objects(), "NetworkPolicy")
    objs = render_objects({"networkPolicy": {"enabled": True}})
    policy = one(objs, "NetworkPolicy")
    pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    hook_labels = one(objs, "Job")["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod_labels.items() and not selector.items() <= hook_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"] and policy["spec"]["ingress"] == []  # no metrics: no way in
    same_namespace = one(render_objects({"networkPolicy": {"enabled": True}, "metrics": {"enabled": True}}),
                         "NetworkPolicy")["spec"]
    assert same_namespace["ingress"] == [{"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": 9090}]}]
    spec = one(render_objects(ALL_FEATURES), "NetworkPolicy")["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["ingress"] == [{"from": ALL_FEATURES["networkPolicy"]["metricsFrom"],
                                "ports": [{"protocol": "TCP", "port": 9090}]}]
    assert spec["egress"] == ALL_FEATURES["networkPolicy"]["egress"]


def test_image_digest_wins_over_tag():
    deploy = one(render_objects({"image": {"tag": "9.9.9", "digest": "sha256:" + "0" * 64}}), "Deployment")
    assert deploy["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/afd-operator@sha256:" + "0" * 64


# --- values.schema.json is enforced -----------------------------------------------------------

BAD_VALUES = {
    "unknown top-level key": ({"replicas": 2}, "additional properties 'replicas'"),
    "typo in a nested key": ({"operator": {"watchNamespace": ["a"]}}, "additional properties 'watchNamespace'"),
    "wrong type": ({"replicaCount": "one"}, "/replicaCount"),
    "bad pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    "bad digest": ({"image": {"digest": "latest"}}, "/image/digest"),
    "privileged health port": ({"healthPort": 80}, "/healthPort"),
    "two replicas without peering": ({"replicaCount": 2}, "/operator/peering"),
    "glob namespaces without cluster-wide RBAC": ({"operator": {"watchNamespaces": ["team-*"]}}, "/rbac/clusterWide"),
    "monitor without metrics": ({"metrics": {"podMonitor": {"enabled": True}}}, "/metrics/enabled"),
    "numeric dashboard label value": ({"dashboards": {"labelValue": 1}}, "/dashboards/labelValue"),
    "bad scrape interval": ({"metrics": {"enabled": True, "podMonitor": {"enabled": True, "interval": "soon"}}},
                            "/metrics/podMonitor/interval"),
    "null resync": ({"operator": {"resyncSeconds": 0}}, "/operator/resyncSeconds"),
    "network policy egress not a list": ({"networkPolicy": {"enabled": True, "egress": {"to": []}}}, "/networkPolicy/egress"),
}


@pytest.mark.parametrize("values,where", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_schema_refuses_bad_values_at_install_time(values, where):
    # Rendering (what `helm install/upgrade/template` do) refuses them, not only an explicit check.
    with pytest.raises(helm_python.HelmValuesError) as err:
        render(values)
    assert where in str(err.value)
    chart = helm_python.Chart.load(str(CHART_DIR))
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema(values)
    chart.close()


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_schema_accepts_the_documented_value_sets(values):
    chart = helm_python.Chart.load(str(CHART_DIR))
    chart.validate_schema(values)
    chart.close()


def test_every_value_is_documented_and_in_the_schema():
    """values.yaml documents each setting just above it, and the strict schema knows every key
    (a strict schema that lags the documented values breaks users: llm-d-modelservice#113)."""
    import json

    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    values = yaml.safe_load("\n".join(lines))

    def walk(node, sub, path):
        for key, value in node.items():
            assert key in sub.get("properties", {}), f"{'.'.join(path + [key])} is in values.yaml but not in the schema"
            child = sub["properties"][key]
            if isinstance(value, dict) and "properties" in child:
                walk(value, child, path + [key])

    walk(values, schema, [])
    stack: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z_][\w.-]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        stack = [(d, k) for d, k in stack if d < indent] + [(indent, key)]
        node = schema
        for _, k in stack:
            node = node.get("properties", {}).get(k, {})
        parents = [_schema_at(schema, [k for _, k in stack[:j]]) for j in range(len(stack))]
        if "properties" in node and not _is_kubernetes_type(node):
            continue  # a group header: its children are documented
        if any(_is_kubernetes_type(p) or "properties" not in p for p in parents):
            continue  # inside a Kubernetes object (documented by Kubernetes)
        previous = next(lines[j] for j in range(i - 1, -1, -1) if lines[j].strip())
        assert previous.strip().startswith("#"), f"values.yaml line {i + 1}: {key!r} has no comment above it"


def _is_kubernetes_type(node: dict) -> bool:
    return node.get("description", "").startswith("Kubernetes ")


def _schema_at(schema: dict, path: list[str]) -> dict:
    for key in path:
        schema = schema.get("properties", {}).get(key, {})
    return schema


# --- NOTES.txt --------------------------------------------------------------------------------

def test_notes_tell_the_user_what_to_apply_next():
    notes = render()["afd-operator/templates/NOTES.txt"]
    assert f"kubectl -n {NAMESPACE} rollout status deployment/{FULLNAME}" in notes
    assert "kubectl apply -n <namespace> -f gpu-nccl-dsv2-lite.yaml" in notes
    assert "crd-upgrade hook Job" in notes
    notes = render({"crds": {"upgradeJob": {"enabled": False}}, "dashboards": {"enabled": True}})[
        "afd-operator/templates/NOTES.txt"]
    assert "kubectl apply --server-side --force-conflicts -f charts/afd-operator/crds/" in notes
    assert "grafana_dashboard=\"1\"" in notes


def test_rendered_flags_are_accepted_by_afd_operator_entrypoint(monkeypatch):
    """The operator image's entrypoint is `afd operator`: the chart's args must get through afd.cli too."""
    from afd import cli as afd_cli
    from afd_operator import cli

    seen = {}
    monkeypatch.setattr(cli, "run_operator", lambda *a, **kw: seen.update(args=a))
    container = one(render_objects(), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    try:
        assert afd_cli.main(["operator", *container["args"]]) == 0
    except SystemExit as exit_:
        pytest.fail(f"afd operator {' '.join(container['args'])} exited with {exit_.code}")
    assert seen["args"][2] == "http://0.0.0.0:8080/healthz"
