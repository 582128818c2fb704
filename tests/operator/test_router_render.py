"""`spec.router` (issue 51 item 3): the router's Deployment, its ranks Service, PodDisruptionBudget and PodMonitor,
the client Service on the router once a router pod is Ready, status.router, and nothing of it when disabled."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest

from afd_operator.model import labels as L
from afd_operator.model.spec import SpecError, parse_owner, parse_spec
from afd_operator.reconcile.deployment import reconcile
from afd_operator.rendering.children import render_all, render_shared
from afd_operator.rendering.router import render_router
from op_testkit import FakeStore, apply_defaults, crd_schema, make_cr

NEWEST = kubernetes_validate.utils.latest_version()
ON = {"enabled": True, "replicas": 3, "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}}}


def _objects(**spec):
    body = make_cr(**spec)
    return render_all(parse_spec(body["spec"]), parse_owner(body))


def _by(objects, kind, name):
    [found] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def test_off_by_default_nothing_of_the_router_and_the_client_service_on_the_attention_pods():
    objects = _objects()
    assert not [o for o in objects if "router" in o["metadata"]["name"] or o["metadata"]["name"] == "demo-ranks"]
    assert _by(objects, "Service", "demo")["spec"]["selector"] == {L.NAME: "demo", L.ROLE: "attention"}


def test_the_router_runs_afd_route_over_the_ready_attention_pods_of_every_group():
    objects = _objects(router=ON, replicas=2, api={"apiKeySecretRef": {"name": "clients", "key": "keys"}})
    ranks = _by(objects, "Service", "demo-ranks")["spec"]
    assert ranks["clusterIP"] == "None" and ranks["publishNotReadyAddresses"] is False
    assert ranks["selector"] == {L.NAME: "demo", L.ROLE: "attention"}  # every group, Ready pods only (DNS)
    deployment = _by(objects, "Deployment", "demo-router")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["afd", "route"] and container["image"] == "registry.example/afd-runtime:0.1.0"
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["AFD_ROUTE_RANKS"] == "demo-ranks.ns.svc"
    assert (env["AFD_HTTP_PORT"], env["AFD_METRICS_PORT"]) == ("8000", "9090")
    assert (env["AFD_ROUTE_RANK_HTTP_PORT"], env["AFD_ROUTE_RANK_METRICS_PORT"]) == ("8000", "9090")
    assert env["AFD_GROUP_SECRET"] == {"secretKeyRef": {"name": "demo-group-secret", "key": "group-secret"}}
    assert env["AFD_API_KEY"] == {"secretKeyRef": {"name": "clients", "key": "keys"}}  # checked as the ranks do
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "metrics"}
    assert container["lifecycle"]["preStop"]["httpGet"]["path"].startswith("/drain?seconds=")
    assert container["resources"] == {"requests": {"cpu": "500m", "memory": "256Mi"}}
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert L.NAME not in labels and L.GROUP not in labels  # the groups' PDB, PodMonitor and pod watch never take it
    budget = _by(objects, "PodDisruptionBudget", "demo-router")["spec"]
    assert budget == {"maxUnavailable": 1, "selector": {"matchLabels": {L.ROUTER: "demo"}}}
    assert _by(objects, "Service", "demo")["spec"]["selector"] == {L.ROUTER: "demo"}
    assert not [o for o in objects if o["kind"] == "PodMonitor"]


def test_a_pod_monitor_scrapes_the_router_when_monitoring_asks():
    objects = _objects(router=ON, monitoring={"podMonitor": True})
    monitor = _by(objects, "PodMonitor", "demo-router")["spec"]
    assert monitor["selector"] == {"matchLabels": {L.ROUTER: "demo"}}
    assert monitor["podMetricsEndpoints"][0]["relabelings"][0]["targetLabel"] == "afd_io_name"


@pytest.mark.parametrize("monitoring", [False, True])
def test_every_router_manifest_is_valid_kubernetes(monitoring):
    body = make_cr(router=ON, monitoring={"podMonitor": monitoring})
    for obj in render_router(parse_spec(body["spec"]), parse_owner(body)):
        if obj["kind"] == "PodMonitor":
            continue  # a CRD of the Prometheus Operator: not in the Kubernetes schemas
        kubernetes_validate.validate(obj, NEWEST, strict=True)


def test_the_router_never_restarts_a_group():
    plain, routed = make_cr(), make_cr(router={**ON, "replicas": 5, "env": [{"name": "AFD_LOG_LEVEL", "value": "DEBUG"}]})
    assert parse_spec(plain["spec"]).revision == parse_spec(routed["spec"]).revision


def test_the_crd_takes_the_router_with_its_defaults_and_refuses_one_port_for_both():
    schema = crd_schema()
    defaulted = apply_defaults(schema, make_cr(router={"enabled": True}))
    jsonschema.Draft7Validator(schema).validate(defaulted)
    assert defaulted["spec"]["router"] == {"enabled": True, "replicas": 2, "port": 8000, "metricsPort": 9090,
                                           "maxUnavailable": 1}
    assert parse_spec(defaulted["spec"]).router.replicas == 2
    assert apply_defaults(schema, make_cr())["spec"]["router"]["enabled"] is False
    with pytest.raises(SpecError, match="router.port and router.metricsPort must differ"):
        parse_spec(make_cr(router={"enabled": True, "port": 9090})["spec"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(apply_defaults(schema, make_cr(router={"replicas": 0})))


class Recording(FakeStore):
    """Keeps the last applied body of each object too."""

    def apply(self, obj):
        super().apply(obj)
        self.bodies = {**getattr(self, "bodies", {}), (obj["kind"], obj["metadata"]["name"]): obj}


def test_reconcile_applies_the_router_and_moves_the_client_service_once_a_router_pod_is_ready():
    store = Recording()
    body = make_cr(router=ON)
    outcome = reconcile(body, [], store, 1000.0, full=True)
    applied = [(kind, name) for kind, name, _ in store.applied]
    assert {("Service", "demo-ranks"), ("Deployment", "demo-router"), ("PodDisruptionBudget", "demo-router")} <= set(applied)
    assert outcome.status["router"] == {"replicas": 3, "readyReplicas": 0, "serving": False, "service": "demo",
                                        "ranksService": "demo-ranks"}
    assert ("PodMonitor", "demo-router") in store.deleted  # monitoring off: pruned at a full reconcile
    assert store.bodies["Service", "demo"]["spec"]["selector"] == {L.NAME: "demo", L.ROLE: "attention"}  # not yet
    store.objects[("Deployment", "ns", "demo-router")] = {"status": {"readyReplicas": 2}}
    applied_before = len(store.applied)
    outcome = reconcile({**body, "status": outcome.status}, [], store, 1001.0)
    assert outcome.status["router"]["serving"] is True and outcome.status["router"]["readyReplicas"] == 2
    assert ("Service", "demo", None) in store.applied[applied_before:]
    assert store.bodies["Service", "demo"]["spec"]["selector"] == {L.ROUTER: "demo"}


def test_the_client_service_selector_follows_the_router():
    body = make_cr(router=ON)
    spec, owner = parse_spec(body["spec"]), parse_owner(body)
    assert render_shared(spec, owner, to_router=True)[0]["spec"]["selector"] == {L.ROUTER: "demo"}
    assert render_shared(spec, owner)[0]["spec"]["selector"] == {L.NAME: "demo", L.ROLE: "attention"}


def test_disabling_the_router_prunes_it_and_clears_its_status():
    store = FakeStore()
    body = make_cr(router={"enabled": False})
    outcome = reconcile({**body, "status": {"router": {"serving": True}}}, [], store, 1000.0, full=True)
    assert {("Deployment", "demo-router"), ("Service", "demo-ranks"), ("PodDisruptionBudget", "demo-router")} <= set(store.deleted)
    assert outcome.status["router"] is None  # merge-patched as null: removed
