"""The operator against a real kube-apiserver (issue 14), run as `afd operator` under the chart's
ServiceAccount: RBAC, owned children, the StatefulSet and garbage collectors, kubectl scale, a rolling
spec change, autoscaling's status. Needs the kit's control plane: see apiserver_kit.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from apiserver_kit import cluster, crd, kubectl, new_namespace, sample_in  # noqa: F401  (fixtures)
from real_cluster import ApiError, Cluster, HelmRelease, eventually

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def operator(cluster, crd, tmp_path_factory):
    """The chart installed, and `afd operator` run with a token of the chart's ServiceAccount
    (TokenRequest API), not the admin's credentials. Yields (cluster as the operator, log path)."""
    release = HelmRelease(cluster, "afd", cluster.new_namespace("afd-system"))
    process = None
    try:
        release.install()
        tmp = tmp_path_factory.mktemp("operator")
        kubeconfig = cluster.token_kubeconfig("afd-afd-operator", release.namespace, tmp / "kubeconfig")
        log = tmp / "operator.log"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        with open(log, "w") as out:
            process = subprocess.Popen([sys.executable, "-m", "afd_operator", "run", "--resync-seconds", "2"],
                                       env=env, stdout=out, stderr=subprocess.STDOUT)
        yield Cluster(kubeconfig), log
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            print(f"operator log: {log}")
        release.uninstall()
        cluster.delete("Namespace", release.namespace)


def test_the_operator_runs_as_its_service_account_not_as_admin(cluster, operator):
    as_operator, _ = operator
    assert cluster.whoami() != as_operator.whoami()
    namespace = operator_namespace(as_operator)
    assert as_operator.whoami() == f"system:serviceaccount:{namespace}:afd-afd-operator"
    with pytest.raises(ApiError) as err:  # e.g. it cannot list Secrets, nor Deployments (it gets its router's by name)
        as_operator.list("Deployment", namespace)
    assert err.value.status == 403


def operator_namespace(as_operator: Cluster) -> str:
    return as_operator.whoami().split(":")[2]


@pytest.fixture(scope="module")
def deployment(cluster, operator):
    """The CPU sample, created by the admin in its own namespace for the operator to reconcile."""
    namespace = cluster.new_namespace("afd-app")
    try:
        yield namespace, cluster.create(sample_in("cpu-zmq-tiny.yaml", namespace))
    finally:
        cluster.delete("Namespace", namespace)


def _children(cluster, namespace, kind, name="tiny-cpu"):
    return cluster.list(kind, namespace, selector=f"afd.io/name={name}")


def _condition(cr, type_):
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def test_the_operator_reconciles_a_sample_into_owned_children(cluster, deployment):
    namespace, created = deployment
    started = time.monotonic()
    sts = eventually(lambda: len(_children(cluster, namespace, "StatefulSet")) == 2
                     and _children(cluster, namespace, "StatefulSet"), 60, "two StatefulSets")
    print(f"StatefulSets {time.monotonic() - started:.2f}s after the CR was created")
    assert sorted(s["metadata"]["name"] for s in sts) == ["tiny-cpu-g0-attn", "tiny-cpu-g0-ffn"]
    services = eventually(lambda: len(_children(cluster, namespace, "Service")) == 3
                          and _children(cluster, namespace, "Service"), 30, "three Services")
    assert sorted(s["metadata"]["name"] for s in services) == ["tiny-cpu", "tiny-cpu-g0-attn", "tiny-cpu-g0-ffn"]
    config_maps = _children(cluster, namespace, "ConfigMap")
    assert config_maps
    attention = next(s for s in sts if s["metadata"]["name"] == "tiny-cpu-g0-attn")
    env = {e["name"]: e.get("value") for e in attention["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AFD_SERVED_MODEL_NAME"] == "afd-test/tiny-qwen3-moe"  # the hub id, not "models"
    owned = sts + services + config_maps + _children(cluster, namespace, "Secret")
    for obj in owned:
        [ref] = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "AFDDeployment", "tiny-cpu", created["metadata"]["uid"], True), obj["metadata"]["name"]

    # The StatefulSet controller creates every rank's Pod (Parallel); no kubelet runs them.
    pods = eventually(lambda: len(_children(cluster, namespace, "Pod")) == 3
                      and _children(cluster, namespace, "Pod"), 60, "three Pods")
    assert sorted(p["metadata"]["name"] for p in pods) == ["tiny-cpu-g0-attn-0", "tiny-cpu-g0-attn-1",
                                                           "tiny-cpu-g0-ffn-0"]
    assert {p["status"]["phase"] for p in pods} == {"Pending"}
    print(f"3 Pods {time.monotonic() - started:.2f}s after the CR was created")

    cr = eventually(lambda: (c := cluster.get("AFDDeployment", "tiny-cpu", namespace)).get("status", {})
                    .get("conditions") and c, 30, "status conditions")
    assert _condition(cr, "Ready")["status"] == "False"
    assert _condition(cr, "Ready")["reason"] == "GroupsNotReady"
    assert (cr["status"]["topology"], cr["status"]["groupsReady"]) == ("2A1F", "0/1")
    assert cr["status"]["observedGeneration"] == cr["metadata"]["generation"]


def test_kubectl_scale_adds_and_removes_groups(cluster, deployment):
    namespace, _ = deployment
    assert "scaled" in kubectl(cluster, "-n", namespace, "scale", "afd/tiny-cpu", "--replicas=2")
    sts = eventually(lambda: len(_children(cluster, namespace, "StatefulSet")) == 4
                     and _children(cluster, namespace, "StatefulSet"), 60, "four StatefulSets")
    assert {s["metadata"]["labels"]["afd.io/group"] for s in sts} == {"0", "1"}
    eventually(lambda: len(_children(cluster, namespace, "Pod")) == 6, 60, "six Pods")
    eventually(lambda: (cluster.get("AFDDeployment", "tiny-cpu", namespace)["status"].get("replicas") == 2),
               30, "status.replicas 2")
    scale = cluster.call("GET", f"/apis/afd.io/v1alpha1/namespaces/{namespace}/afddeployments/tiny-cpu/scale")
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (2, 2)
    assert scale["status"]["selector"] == "afd.io/name=tiny-cpu,afd.io/role=attention"

    kubectl(cluster, "-n", namespace, "scale", "afd/tiny-cpu", "--replicas=1")
    eventually(lambda: len(_children(cluster, namespace, "StatefulSet")) == 2, 60, "back to two StatefulSets")
    eventually(lambda: len(_children(cluster, namespace, "Pod")) == 3, 60, "the GC to remove group 1's Pods")


def test_a_spec_change_rolls_the_group(cluster, deployment):
    namespace, _ = deployment
    before = cluster.get("AFDDeployment", "tiny-cpu", namespace)["status"]["updateRevision"]
    new_image = "registry.example/afd-runtime:0.2.0"
    cluster.merge_patch("AFDDeployment", "tiny-cpu", namespace, {"spec": {"image": new_image}})

    def rolled():
        cr = cluster.get("AFDDeployment", "tiny-cpu", namespace)
        revision = cr["status"].get("updateRevision")
        pods = _children(cluster, namespace, "Pod")
        return (revision != before and len(pods) == 3
                and {p["metadata"]["labels"]["afd.io/revision"] for p in pods} == {revision}
                and {c["image"] for p in pods for c in p["spec"]["containers"]} == {new_image} and revision)

    revision = eventually(rolled, 90, "every Pod at the new revision and image")
    for sts in _children(cluster, namespace, "StatefulSet"):
        assert sts["spec"]["template"]["metadata"]["labels"]["afd.io/revision"] == revision


def test_deleting_the_resource_lets_the_garbage_collector_remove_everything(cluster, deployment):
    namespace, _ = deployment
    started = time.monotonic()
    cluster.delete("AFDDeployment", "tiny-cpu", namespace)

    def gone():
        return not any(_children(cluster, namespace, kind)
                       for kind in ("StatefulSet", "Service", "ConfigMap", "Secret", "Pod"))

    eventually(gone, 90, "the GC to remove every child")
    print(f"everything gone {time.monotonic() - started:.2f}s after the delete")


def test_the_operator_was_never_forbidden(operator, deployment):
    """Its RBAC covers all it did. (Other 403s can appear: CRs of the sample tests whose
    namespaces are still terminating, "unable to create new content in namespace".)"""
    namespace, _ = deployment
    _, log = operator
    text = log.read_text()
    denied = [line for line in text.splitlines() if "cannot " in line and "system:serviceaccount:" in line]
    assert denied == [], "\n".join(denied[:20])
    ours = [line for line in text.splitlines() if namespace in line and (" WARNING " in line or " ERROR " in line)]
    assert ours == [], "\n".join(ours[:20])
    # it did the work: the create, then the scales and the image change (kopf may merge the
    # last two into one update when they come close together)
    assert text.count("Handler 'build_registry.<locals>.on_change' succeeded") == 1, text[-3000:]
    assert text.count("Handler 'build_registry.<locals>.on_change/spec' succeeded") >= 2, text[-3000:]


def test_an_autoscaled_sample_starts_at_min_groups_and_its_status_is_kept(cluster, operator, new_namespace):
    """The operator's status.autoscaling and kubectl scale's refusal against the real API server
    (fields the CRD did not declare would be pruned silently). No pod runs: no metrics to judge.
    Last in the file: test_the_operator_was_never_forbidden counts the creates it saw."""
    namespace = new_namespace("afd-scaled")
    body = sample_in("cpu-zmq-tiny-autoscaling.yaml", namespace)
    body["spec"]["autoscaling"]["minGroups"] = 2
    cluster.create(body)
    name = body["metadata"]["name"]
    eventually(lambda: len(_children(cluster, namespace, "StatefulSet", name)) == 4, 60, "two groups (minGroups)")
    state = eventually(lambda: ((s := cluster.get("AFDDeployment", name, namespace).get("status", {}).get("autoscaling"))
                                and s["currentGroups"] == 2 and s), 30, "status.autoscaling with both groups")
    assert state["desiredGroups"] == 2
    assert state["reason"] == "holding: 2 group(s) warming up" and "observed" not in state  # no pod runs: nothing read
    with pytest.raises(subprocess.CalledProcessError) as err:
        kubectl(cluster, "-n", namespace, "scale", f"afd/{name}", "--replicas=3")
    assert "spec.replicas cannot change while spec.autoscaling.enabled is true" in err.value.stderr
