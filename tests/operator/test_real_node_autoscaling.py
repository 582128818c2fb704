"""spec.autoscaling on a real single-node cluster: load raises the groups 1 → 2, a light load
brings them back to 1 through the drain, and no request through the client Service fails.

The operator runs in the cluster (the chart), reads the attention ranks' /metrics on their pod
IPs, and drains the leaving group's ranks over /drain. Each step is timed and printed
(`pytest -s`), and written to $AFD_E2E_REPORT when set. Needs the kit with a node (node_kit.py);
skips otherwise. AFD_E2E_REUSE_IMAGES=1 skips the image build (the node keeps the last import).
"""

from __future__ import annotations

import os
import time

import pytest

from node_kit import OPERATOR_IMAGE, Load, build_and_import_images, node_cluster_or_skip, service_url, tiny_model_on_the_host
from real_cluster import Cluster, HelmRelease, eventually
from test_real_node_e2e import SERVED, Steps, _answers, _operator_ready, _sample

pytestmark = pytest.mark.timeout(1800)
NAME = "tiny-cpu"
# Few sequences per rank, so that a handful of clients leaves requests waiting: the signal here
# (6 clients: 4 run, 2 wait; more overloads a 2-CPU node past the clients' 60 s read timeout).
AUTOSCALING = {"enabled": True, "minGroups": 1, "maxGroups": 2, "targets": {"waitingPerGroup": 1},
               "scaleUpWindowSeconds": 15, "scaleDownWindowSeconds": 30, "cooldownSeconds": 10,
               "sampleIntervalSeconds": 5, "drainTimeoutSeconds": 300}


def _autoscaled(namespace, model_dir):
    body = _sample(namespace, model_dir, replicas=1)
    body["spec"].pop("ratio")
    body["spec"]["afd"]["maxNumSeqs"] = 2
    body["spec"]["autoscaling"] = AUTOSCALING
    return body


def _state(cluster: Cluster, namespace: str) -> dict:
    return ((cluster.get("AFDDeployment", NAME, namespace) or {}).get("status") or {})


def _groups_ready(cluster, namespace, groups):
    status = _state(cluster, namespace)
    scaled = status.get("autoscaling") or {}
    if status.get("groupsReady") == f"{groups}/{groups}" and status.get("replicas") == groups \
            and scaled.get("desiredGroups") == groups:
        return f"groups {status['groupsReady']}: {scaled.get('reason', '')[:120]}"
    return None


def _desired(cluster, namespace, groups):
    scaled = _state(cluster, namespace).get("autoscaling") or {}
    return scaled.get("desiredGroups") == groups and f"{scaled.get('signal')}: {scaled.get('reason', '')[:160]}"


def _events(cluster, namespace, reason):
    return [e["message"] for e in cluster.list("Event", namespace) if e.get("reason") == reason]


def test_load_adds_a_group_and_a_light_load_drains_it_away_without_a_failed_request(tmp_path_factory):
    cluster = node_cluster_or_skip()
    steps = Steps()
    if os.environ.get("AFD_E2E_REUSE_IMAGES") != "1":
        steps.run("build images and import them into the node", build_and_import_images)
    model_dir = steps.run("tiny model on the host", tiny_model_on_the_host, tmp_path_factory.mktemp("as-model") / "tiny")
    release = HelmRelease(cluster, "afd", cluster.new_namespace("afd-system"),
                          {"image": {"repository": OPERATOR_IMAGE.rsplit(":", 1)[0], "tag": "dev", "pullPolicy": "Never"},
                           "operator": {"resyncSeconds": 2}})
    namespace = cluster.new_namespace("afd-as")
    try:
        steps.run("helm install", release.install)
        steps.run("operator pod Ready", eventually, lambda: _operator_ready(cluster, release.namespace), 300,
                  "operator Ready", 1)
        cluster.create(_autoscaled(namespace, model_dir))
        steps.run("apply the sample with autoscaling 1..2; Ready 1/1", eventually,
                  lambda: _groups_ready(cluster, namespace, 1), 600, "1 group Ready", 1)
        url = service_url(cluster, namespace, NAME)
        steps.run("the Service answers", eventually, lambda: _answers(url), 60, "GET /health through the Service", 1)

        with Load(url, SERVED, clients=6, max_tokens=16) as heavy:
            steps.run("6 clients: the autoscaler asks for 2 groups", eventually,
                      lambda: _desired(cluster, namespace, 2), 300, "desiredGroups 2", 1)
            steps.run("group 1 warmed up; Ready 2/2", eventually, lambda: _groups_ready(cluster, namespace, 2), 600,
                      "2 groups Ready", 1)
            time.sleep(10)  # both groups serve the load
        steps.run("6 clients while scaling up", lambda: heavy)
        with Load(url, SERVED, clients=1, max_tokens=16) as light:
            steps.run("1 client: the autoscaler asks for 1 group", eventually,
                      lambda: _desired(cluster, namespace, 1), 300, "desiredGroups 1", 1)
            steps.run("group 1 drained and deleted; Ready 1/1", eventually,
                      lambda: _groups_ready(cluster, namespace, 1), 600, "1 group Ready", 1)
            time.sleep(5)
        steps.run("1 client while scaling down", lambda: light)
        assert heavy.outcomes and light.outcomes
        failed = heavy.failures() + light.failures()
        assert not failed, "\n".join(f"{o.kind}: {o.detail}" for o in failed[:10])
        assert _events(cluster, namespace, "AutoscaleUp") and _events(cluster, namespace, "GroupDraining")
        assert any("ScaleDown (drained)" in m for m in _events(cluster, namespace, "GroupDeleted")), \
            _events(cluster, namespace, "GroupDeleted")
    finally:
        for reason in ("AutoscaleUp", "AutoscaleDown", "GroupDraining", "GroupDeleted"):
            for message in _events(cluster, namespace, reason):
                print(f"[autoscale] {reason}: {message}")
        release.uninstall()
        cluster.delete("Namespace", namespace)
        cluster.delete("Namespace", release.namespace)
        print("\n" + steps.table())
        if report := os.environ.get("AFD_E2E_REPORT"):
            with open(report, "w") as out:
                out.write(steps.table() + "\n")
