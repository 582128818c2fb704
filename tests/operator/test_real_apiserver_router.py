"""`spec.router` against a real kube-apiserver (issue 51 item 3): the CRD takes it (defaulted, its CEL rule
applied), the API server keeps the rendered router Deployment, ranks Service and PodDisruptionBudget as
rendered, and `afd operator` under the chart's ServiceAccount creates them, reports status.router, keeps the
client Service on the attention pods while no router pod is Ready, and removes the router when it is disabled.
Needs the kit's control plane: see apiserver_kit.py.
"""

from __future__ import annotations

import pytest

from apiserver_kit import cluster, crd, new_namespace, namespace, sample_in  # noqa: F401  (fixtures)
from op_testkit import make_cr
from real_cluster import ApiError, eventually
from test_real_apiserver_operator import operator  # noqa: F401  (fixture: the chart and `afd operator`)

pytestmark = pytest.mark.timeout(300)
ROUTER = {"enabled": True, "replicas": 2, "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}}}


def test_the_crd_takes_the_router_defaulted_and_refuses_one_port_for_both(cluster, namespace):
    body = make_cr(name="routed", namespace=namespace, router={"enabled": True})
    del body["metadata"]["uid"]
    stored = cluster.create(body)
    assert stored["spec"]["router"] == {"enabled": True, "replicas": 2, "port": 8000, "metricsPort": 9090,
                                        "maxUnavailable": 1}
    plain = make_cr(name="plain", namespace=namespace)
    del plain["metadata"]["uid"]
    assert cluster.create(plain)["spec"]["router"]["enabled"] is False
    clash = make_cr(name="clash", namespace=namespace, router={"enabled": True, "port": 9090})
    del clash["metadata"]["uid"]
    with pytest.raises(ApiError) as err:
        cluster.create(clash, dry_run=True)
    assert "router.port and router.metricsPort must differ" in err.value.message


def test_the_rendered_router_objects_are_kept_as_rendered(cluster, namespace):
    from afd_operator.model.spec import parse_owner, parse_spec
    from afd_operator.rendering.router import render_router

    body = make_cr(name="routed", namespace=namespace, router=ROUTER, api={"apiKeySecretRef": {"name": "clients"}})
    objects = render_router(parse_spec(body["spec"]), parse_owner(body))
    assert [o["kind"] for o in objects] == ["Service", "Deployment", "PodDisruptionBudget"]
    for obj in objects:
        obj["metadata"].pop("ownerReferences")
        stored = cluster.apply(obj, dry_run=True)  # strict field validation: a misspelt field is refused
        if obj["kind"] == "Deployment":
            pod = stored["spec"]["template"]["spec"]
            assert pod["containers"][0]["command"] == ["afd", "route"]
            assert pod["containers"][0]["lifecycle"]["preStop"]["httpGet"]["path"] == "/drain?seconds=35"
            assert pod["automountServiceAccountToken"] is False
        if obj["kind"] == "Service":
            assert stored["spec"]["clusterIP"] == "None" and not stored["spec"].get("publishNotReadyAddresses")


def test_the_operator_creates_reports_and_removes_the_router(cluster, operator, new_namespace):
    namespace = new_namespace("afd-routed")
    body = sample_in("cpu-zmq-tiny.yaml", namespace)
    body["spec"]["router"] = ROUTER
    cluster.create(body)
    name = body["metadata"]["name"]
    deployment = eventually(lambda: cluster.get("Deployment", f"{name}-router", namespace), 60, "the router Deployment")
    assert deployment["spec"]["replicas"] == 2
    [ref] = deployment["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"]) == ("AFDDeployment", name)
    assert eventually(lambda: cluster.get("Service", f"{name}-ranks", namespace), 30, "the ranks Service")
    assert eventually(lambda: cluster.get("PodDisruptionBudget", f"{name}-router", namespace), 30, "the router's PDB")
    pods = eventually(lambda: cluster.list("Pod", namespace, selector=f"afd.io/router={name}"), 60, "router pods")
    assert all("afd.io/name" not in p["metadata"]["labels"] for p in pods)  # no group selector takes them
    status = eventually(lambda: cluster.get("AFDDeployment", name, namespace).get("status", {}).get("router"), 30,
                        "status.router")
    assert status == {"replicas": 2, "readyReplicas": 0, "serving": False, "service": name,
                      "ranksService": f"{name}-ranks"}  # the image is not there: no router pod is Ready
    client = cluster.get("Service", name, namespace)
    assert client["spec"]["selector"] == {"afd.io/name": name, "afd.io/role": "attention"}  # not yet on the router

    cluster.merge_patch("AFDDeployment", name, namespace, {"spec": {"router": {"enabled": False}}})
    eventually(lambda: cluster.get("Deployment", f"{name}-router", namespace) is None
               and cluster.get("Service", f"{name}-ranks", namespace) is None
               and cluster.get("PodDisruptionBudget", f"{name}-router", namespace) is None, 60,
               "the router removed")
    eventually(lambda: "router" not in cluster.get("AFDDeployment", name, namespace).get("status", {}), 30,
               "status.router cleared")
    assert len(cluster.list("StatefulSet", namespace, selector=f"afd.io/name={name}")) == 2  # the group stayed
