"""The chart against a real kube-apiserver (issue 14): `helm install` and uninstall (emulated:
helm-python-sdk renders, it cannot install; see HelmRelease in real_cluster.py for what is and is not done
as Helm would), the opt-in NetworkPolicy, the CRD upgrade hook. Needs the kit's control plane: see
apiserver_kit.py.
"""

from __future__ import annotations

import time

import pytest
import yaml

from apiserver_kit import CRD_NAME, cluster, crd, new_namespace  # noqa: F401  (fixtures)
from real_cluster import CHART, HOOK, INSTALL_ORDER, HelmRelease, eventually

pytestmark = pytest.mark.timeout(300)


def test_helm_install_creates_the_crd_and_the_operator_and_uninstall_removes_it(cluster, crd, new_namespace):
    release = HelmRelease(cluster, "afd-install", new_namespace("afd-system"))
    kinds = sorted(f"{o['kind']}" for o in release.objects)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]
    # A first install: no CRD yet (deleting it also deletes every AFDDeployment).
    cluster.delete("CustomResourceDefinition", CRD_NAME)
    eventually(lambda: cluster.get("CustomResourceDefinition", CRD_NAME) is None, 60, "the CRD to go")
    started = time.monotonic()
    release.install()
    installed = time.monotonic() - started
    created = cluster.wait_established(CRD_NAME)
    assert created["metadata"]["uid"] != crd["metadata"]["uid"]  # the install made it afresh
    assert len(release.present()) == len(release.objects) == 4
    deployment = cluster.get("Deployment", "afd-install-afd-operator", release.namespace)
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "afd-install-afd-operator"
    # The Deployment controller makes the ReplicaSet and the Pod (Pending: no kubelet here).
    pods = eventually(lambda: cluster.list("Pod", release.namespace), 30, "the operator's Pod")
    assert pods[0]["status"]["phase"] == "Pending"
    binding = cluster.get("ClusterRoleBinding", "afd-install-afd-operator")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "afd-install-afd-operator",
                                    "namespace": release.namespace}]

    started = time.monotonic()
    release.uninstall()
    eventually(lambda: not release.present(), 30, "uninstall")
    eventually(lambda: not cluster.list("Pod", release.namespace), 60, "the GC to remove the operator's Pod")
    print(f"install {installed:.2f}s, uninstall (with GC) {time.monotonic() - started:.2f}s")
    assert cluster.get("CustomResourceDefinition", CRD_NAME) is not None  # Helm never deletes crds/


def test_the_operators_network_policy_is_kept_and_selects_only_the_operator_pod(cluster, crd, new_namespace):
    """Issue 35: the chart's opt-in NetworkPolicy (metrics on, scrapes from a monitoring namespace,
    egress rules) is stored as rendered, and its selector finds the operator's Pod and nothing else."""
    values = {"metrics": {"enabled": True}, "networkPolicy": {
        "enabled": True, "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        "egress": [{"ports": [{"protocol": "UDP", "port": 53}]}, {"to": [{"ipBlock": {"cidr": "10.96.0.1/32"}}]}]}}
    release = HelmRelease(cluster, "afd-netpol", new_namespace("afd-system"), values)
    rendered = next(o for o in release.objects if o["kind"] == "NetworkPolicy")
    release.install()
    try:
        stored = cluster.get("NetworkPolicy", rendered["metadata"]["name"], release.namespace)
        assert stored["spec"]["ingress"] == rendered["spec"]["ingress"]
        assert stored["spec"]["egress"] == rendered["spec"]["egress"]
        assert stored["spec"]["policyTypes"] == ["Ingress", "Egress"]
        selector = ",".join(f"{k}={v}" for k, v in stored["spec"]["podSelector"]["matchLabels"].items())
        pods = eventually(lambda: cluster.list("Pod", release.namespace, selector=selector), 30, "the operator's Pod")
        assert [p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods] == ["operator"]
    finally:
        release.uninstall()
    eventually(lambda: cluster.get("NetworkPolicy", rendered["metadata"]["name"], release.namespace) is None, 30,
               "uninstall to remove the NetworkPolicy")


def test_the_crd_upgrade_hook_objects_are_accepted(cluster, crd, new_namespace):
    """The pre-install/pre-upgrade hook (ServiceAccount, ClusterRole, binding, ConfigMap with the
    CRDs, Job): accepted by the API server (dry run; its Job needs a kubelet to run)."""
    import helm_python

    namespace = new_namespace("afd-hook")
    chart = helm_python.Chart.load(str(CHART))
    try:
        rendered = chart.render(None, name="afd", namespace=namespace)
    finally:
        chart.close()
    hooks = [d for name, text in rendered.items() if not name.endswith("NOTES.txt")
             for d in yaml.safe_load_all(text) if d and HOOK in (d["metadata"].get("annotations") or {})]
    assert sorted(h["kind"] for h in hooks) == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Job",
                                                 "ServiceAccount"]
    for hook in sorted(hooks, key=lambda d: INSTALL_ORDER.index(d["kind"])):
        cluster.apply(hook, dry_run=True)
