"""End to end on a real single-node cluster: images → chart → sample → answers, under disruptions.

What a new user does between `helm install` and the first answer, on the kit's real node
(kube-apiserver, controller-manager, scheduler, kubelet with containerd/runc, a Service/DNS
stand-in): build and import the images, install the chart (the operator runs in the cluster
under its ServiceAccount), apply the CPU sample with a host-path tiny model, wait for Ready,
then ask through the client Service while it scales, loses an FFN pod and rolls out; finally
delete the resource and uninstall. Every step is asserted and timed; the table is printed
(`pytest -s`) and written to $AFD_E2E_REPORT when set.

The load is closed-loop clients (completions and streams) through the client Service; during
the FFN-pod deletion in one group and during the rollout, no request may fail.

Needs the kit with a node (see node_kit.py); skips with the reason otherwise (CI).
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import yaml

from node_kit import (
    OPERATOR_IMAGE, RUNTIME_IMAGE, Load, build_and_import_images, node_cluster_or_skip, service_url,
    tiny_model_on_the_host,
)
from op_testkit import SAMPLES
from real_cluster import Cluster, HelmRelease, eventually

pytestmark = pytest.mark.timeout(1800)
NAME = "tiny-cpu"
SERVED = "tiny-qwen3-moe"


class Steps:
    """The step table: what was done, how long it took, what it showed."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, str]] = []

    def run(self, what: str, action, *args):
        started = time.monotonic()
        result = action(*args)
        self.rows.append((what, time.monotonic() - started, _describe(result)))
        print(f"[e2e] {what}: {self.rows[-1][1]:.1f}s {self.rows[-1][2]}", flush=True)
        return result

    def table(self) -> str:
        lines = ["| step | seconds | result |", "|---|---:|---|"]
        lines += [f"| {what} | {seconds:.1f} | {result} |" for what, seconds, result in self.rows]
        return "\n".join(lines)


def _describe(result) -> str:
    if isinstance(result, Load):
        return result.summary()
    return "" if result is None or isinstance(result, (dict, list)) else str(result)


def _ready(cluster: Cluster, namespace: str, groups: int, revision: str | None = None):
    cr = cluster.get("AFDDeployment", NAME, namespace) or {}
    status = cr.get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    if conditions.get("Ready") != "True" or status.get("groupsReady") != f"{groups}/{groups}":
        return None
    if revision is not None and status.get("updateRevision") == revision:
        return None  # still the old revision
    pods = cluster.list("Pod", namespace, selector=f"afd.io/name={NAME}")
    return f"{len(pods)} pods, groups {status['groupsReady']}, revision {status.get('updateRevision')}"


def _wait_ready(cluster, namespace, groups, timeout=600, revision=None):
    return eventually(lambda: _ready(cluster, namespace, groups, revision), timeout, f"{NAME} Ready with {groups} group(s)", 1)


def _sample(namespace: str, model_dir, replicas: int) -> dict:
    body = yaml.safe_load(next(p for p in SAMPLES if p.name == "cpu-zmq-tiny.yaml").read_text())
    body = copy.deepcopy(body)
    body["metadata"]["namespace"] = namespace
    spec = body["spec"]
    spec.update(replicas=replicas, image=RUNTIME_IMAGE, imagePullPolicy="Never", servedModelName=SERVED)
    spec["model"] = {"uri": str(model_dir)}
    spec["ratio"] = {"mode": "Advise", "sampleIntervalSeconds": 5}  # the operator scrapes the ranks in the cluster
    for role in ("attention", "ffn"):  # two groups of three pods fit a 2-CPU node
        spec[role]["resources"]["requests"]["cpu"] = "250m"
    return body


def _ffn_shards(cluster: Cluster, namespace: str, shards: int) -> str | None:
    """The running FFN pods when there are `shards` of them, each told its shard."""
    pods = [pod for pod in cluster.list("Pod", namespace, selector=f"afd.io/name={NAME},afd.io/role=ffn")
            if pod.get("status", {}).get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")]
    if len(pods) != shards:
        return None
    env = [{e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])} for pod in pods]
    assert all(e.get("AFD_FFN_EXPERT_PARALLEL") == str(shards) for e in env), env
    return ", ".join(sorted(pod["metadata"]["name"] for pod in pods))


def _answers(url: str) -> str | None:
    import httpx

    try:
        response = httpx.get(f"{url}/health", timeout=5)
    except httpx.HTTPError:
        return None
    return f"{response.status_code} from {response.headers.get('server')}" if response.status_code == 200 else None


def _ask(url: str) -> str:
    import httpx

    listed = httpx.get(f"{url}/v1/models", timeout=30)
    assert listed.status_code == 200 and listed.content, (listed.status_code, dict(listed.headers), listed.content[:300])
    models = listed.json()
    assert [m["id"] for m in models["data"]] == [SERVED]
    body = {"model": SERVED, "prompt": "Hello", "max_tokens": 5, "temperature": 0}
    started = time.monotonic()
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 5
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200 and events[-1] == "data: [DONE]" and len(events) == 6, events
    return f"completion in {time.monotonic() - started:.2f}s; stream of 5 chunks"


def _under_load(url: str, disruption, seconds_after: float = 5.0) -> Load:
    """Run `disruption` while clients ask through the Service; every request must succeed."""
    with Load(url, SERVED) as load:
        time.sleep(3)
        disruption()
        time.sleep(seconds_after)
    assert load.outcomes, "no request completed"
    assert not load.failures(), load.summary() + "\n" + "\n".join(f"{o.kind}: {o.detail}" for o in load.failures()[:10])
    return load


def test_a_new_user_from_helm_install_to_answers_under_disruptions(tmp_path_factory):
    cluster = node_cluster_or_skip()
    steps = Steps()
    if os.environ.get("AFD_E2E_REUSE_IMAGES") != "1":  # =1: the images of the last run are still in the node
        steps.run("build images (make images) and import them into the node", build_and_import_images)
    model_dir = steps.run("afd make-tiny-model on the host (hostPath)", tiny_model_on_the_host,
                          tmp_path_factory.mktemp("e2e-model") / "tiny")
    release = HelmRelease(cluster, "afd", cluster.new_namespace("afd-system"),
                          {"image": {"repository": OPERATOR_IMAGE.rsplit(":", 1)[0], "tag": "dev", "pullPolicy": "Never"},
                           "operator": {"resyncSeconds": 2}})
    namespace = cluster.new_namespace("afd-e2e")
    try:
        steps.run("helm install (emulated; the operator runs in the cluster)", release.install)
        steps.run("operator pod Ready", eventually, lambda: _operator_ready(cluster, release.namespace), 300, "operator Ready", 1)
        cluster.create(_sample(namespace, model_dir, replicas=1))
        steps.run("apply the CPU sample; Ready 1/1", _wait_ready, cluster, namespace, 1)
        url = service_url(cluster, namespace, NAME)
        steps.run("the Service routes to a ready rank (the proxy programs it asynchronously)", eventually,
                  lambda: _answers(url), 60, "GET /health through the Service", 1)
        steps.run("completion and stream through the client Service", _ask, url)

        cluster.merge_patch("AFDDeployment", NAME, namespace, {"spec": {"replicas": 2}}, sub="scale")
        steps.run("scale to 2 groups; Ready 2/2", _wait_ready, cluster, namespace, 2)

        def delete_ffn_pod():
            cluster.delete("Pod", f"{NAME}-g1-ffn-0", namespace)

        steps.run("load while group 1's FFN pod is deleted", _under_load, url, delete_ffn_pod, 20.0)
        steps.run("group 1 back; Ready 2/2", _wait_ready, cluster, namespace, 2)
        steps.run("spec.ratio Advise: status.ratio from the ranks' live metrics", eventually,
                  lambda: _ratio_seen(cluster, namespace), 120, "status.ratio with busy figures per group", 2)

        revision = cluster.get("AFDDeployment", NAME, namespace)["status"]["updateRevision"]

        def change_spec():
            cluster.merge_patch("AFDDeployment", NAME, namespace, {"spec": {"afd": {"maxNumSeqs": 8}}})
            _wait_ready(cluster, namespace, 2, revision=revision)

        steps.run("load during a rollout of both groups (spec change)", _under_load, url, change_spec)

        cluster.merge_patch("AFDDeployment", NAME, namespace, {"spec": {"replicas": 1}}, sub="scale")
        steps.run("scale back to 1 group; Ready 1/1", _wait_ready, cluster, namespace, 1)
        revision = cluster.get("AFDDeployment", NAME, namespace)["status"]["updateRevision"]
        cluster.merge_patch("AFDDeployment", NAME, namespace, {"spec": {"ffn": {"expertParallel": 2}}})
        steps.run("spec.ffn.expertParallel 2: the group rolls to two FFN shard pods; Ready 1/1",
                  lambda: _wait_ready(cluster, namespace, 1, revision=revision))
        steps.run("the FFN rank runs as two shard pods", eventually, lambda: _ffn_shards(cluster, namespace, 2), 120,
                  "two running FFN shard pods", 1)
        steps.run("completion and stream through the Service, experts on two shards", _ask, url)

        cluster.delete("AFDDeployment", NAME, namespace)
        steps.run("delete the resource; children garbage-collected", eventually,
                  lambda: _gone(cluster, namespace), 180, "every child gone", 1)
        release.uninstall()
        steps.run("helm uninstall; the operator pod goes", eventually,
                  lambda: not cluster.list("Pod", release.namespace) and "no pod left", 120, "the operator pod gone", 1)
    finally:
        for event in cluster.list("Event", namespace):
            if event.get("type") == "Warning":
                print(f"[e2e] warning event: {event['involvedObject']['name']}: {event['reason']}: {event['message'][:300]}")
        release.uninstall()  # idempotent: what is already gone is skipped
        cluster.delete("Namespace", namespace)
        cluster.delete("Namespace", release.namespace)
        print("\n" + steps.table())
        if report := os.environ.get("AFD_E2E_REPORT"):
            with open(report, "w") as out:
                out.write(steps.table() + "\n")


def _ratio_seen(cluster: Cluster, namespace: str):
    """What the operator concluded from scraping the ranks in the cluster: a sample time and, per
    group, busy figures (once the cost model fits) or the reason it cannot fit yet."""
    ratio = ((cluster.get("AFDDeployment", NAME, namespace) or {}).get("status") or {}).get("ratio") or {}
    groups = ratio.get("groups") or []
    if ratio.get("mode") != "Advise" or not ratio.get("lastSampleTime") or sorted(g["index"] for g in groups) != [0, 1]:
        return None
    said = "; ".join(f"g{g['index']} attention {g['attentionBusyPercent']}% / FFN {g['ffnBusyPercent']}% busy"
                     if "attentionBusyPercent" in g else f"g{g['index']}: {g.get('message', '')[:80]}" for g in groups)
    return f"{said}; recommended {ratio.get('recommended') or '-'}"


def _operator_ready(cluster: Cluster, namespace: str):
    pods = cluster.list("Pod", namespace)
    ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                    for c in (p.get("status") or {}).get("conditions") or [])]
    return f"{ready[0]['metadata']['name']}" if ready else None


def _gone(cluster: Cluster, namespace: str):
    left = [f"{kind}/{o['metadata']['name']}" for kind in ("StatefulSet", "Pod", "Service", "ConfigMap")
            for o in cluster.list(kind, namespace, selector=f"afd.io/name={NAME}")]
    return "everything removed" if not left else None
