"""The router (`spec.router`, issue 51 item 3) on a real single-node cluster: requests through the client Service
reach the router pods, which spread them over two groups' attention ranks.

- a shared prefix: every request after the first reports cached tokens (`cached_tokens`, prefix caching on the
  ranks), at least 90 %;
- an attention pod deleted under 8 streams through the router: none fails, every text equals an undisturbed run's
  (the router moves each cut stream to another rank);
- a router pod deleted under load: a request may fail only explicitly (an HTTP error the client sees, its
  connection was to that pod), and every request started 5 s after the deletion succeeds;
- a rollout of the router (a changed env): no request fails.

Needs the kit with a node and images built from this tree (see node_kit.py); skips with the reason otherwise.
`AFD_E2E_REUSE_IMAGES=1` keeps the images already in the node.
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from node_kit import (
    OPERATOR_IMAGE, RUNTIME_IMAGE, Load, build_and_import_images, node_cluster_or_skip, service_url,
    tiny_model_on_the_host,
)
from real_cluster import Cluster, HelmRelease, eventually
from test_real_node_e2e import SERVED, _operator_ready, _sample

pytestmark = pytest.mark.timeout(1800)
NAME = "tiny-cpu"
SYSTEM = "You are a careful assistant for operators of large model deployments on Kubernetes. " * 8
STREAMS, TOKENS = 8, 48


def _routed_and_ready(cluster: Cluster, namespace: str) -> str | None:
    status = (cluster.get("AFDDeployment", NAME, namespace) or {}).get("status") or {}
    router = status.get("router") or {}
    if status.get("groupsReady") != "2/2" or router.get("readyReplicas") != 2 or not router.get("serving"):
        return None
    selector = cluster.get("Service", NAME, namespace)["spec"]["selector"]
    return f"groups 2/2, router 2/2, client Service on {selector}" if selector == {"afd.io/router": NAME} else None


def _chat(url: str, content: str, tokens: int = 4) -> dict:
    body = {"model": SERVED, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
            "max_tokens": tokens, "temperature": 0}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _stream_texts(url: str, during=None) -> list[tuple[str | None, str]]:
    """STREAMS greedy streams (error, text) through the router; `during()` runs once all are under way."""
    results: list[tuple[str | None, str]] = [(None, "")] * STREAMS
    started = [0] * STREAMS

    def one(index: int) -> None:
        body = {"model": SERVED, "prompt": f"Story number {index}:", "max_tokens": TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text, error = "", None
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                if response.status_code != 200:
                    error = f"HTTP {response.status_code}"
                for line in response.iter_lines():
                    if line.startswith('data: {"error"'):
                        error = line
                    elif line.startswith("data: {"):
                        started[index] += 1
                        text += json.loads(line[6:])["choices"][0]["text"]
                    elif line == "data: [DONE]":
                        break
                else:
                    error = error or "no [DONE]"
        except httpx.HTTPError as err:
            error = f"{type(err).__name__}: {err}"
        results[index] = (error, text)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    if during is not None:
        eventually(lambda: min(started) >= 4, 120, "every stream under way", 0.1)
        during()
    for thread in threads:
        thread.join(240)
    return results


def test_the_router_routes_by_prefix_moves_streams_and_survives_its_own_pods_going(tmp_path_factory):
    cluster = node_cluster_or_skip()
    if os.environ.get("AFD_E2E_REUSE_IMAGES") != "1":
        build_and_import_images()
    model_dir = tiny_model_on_the_host(tmp_path_factory.mktemp("router-model") / "tiny")
    release = HelmRelease(cluster, "afd", cluster.new_namespace("afd-system"),
                          {"image": {"repository": OPERATOR_IMAGE.rsplit(":", 1)[0], "tag": "dev", "pullPolicy": "Never"},
                           "operator": {"resyncSeconds": 2}})
    namespace = cluster.new_namespace("afd-router")
    try:
        release.install()
        eventually(lambda: _operator_ready(cluster, release.namespace), 300, "operator Ready", 1)
        body = _sample(namespace, model_dir, replicas=2)
        body["spec"].pop("ratio")
        body["spec"]["router"] = {"enabled": True, "replicas": 2,
                                  "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}}
        cluster.create(body)
        print("[router]", eventually(lambda: _routed_and_ready(cluster, namespace), 900, "groups and router Ready", 1))
        url = service_url(cluster, namespace, NAME)
        eventually(lambda: _chat(url, "hello"), 60, "an answer through the router", 1)

        usages = [_chat(url, f"question {i}")["usage"] for i in range(11)]
        cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in usages[1:]]
        if all(c is None for c in cached):
            pytest.fail(f"no usage reports cached_tokens: prefix caching is not in this image ({usages[1]})")
        hits = sum(1 for c in cached if c and c >= 32)
        print(f"[router] shared prefix: {hits}/10 requests after the first hit the cache ({cached})")
        assert hits >= 9

        undisturbed = _stream_texts(url)
        assert all(error is None for error, _ in undisturbed), undisturbed
        disturbed = _stream_texts(url, lambda: cluster.delete("Pod", f"{NAME}-g0-attn-0", namespace))
        assert [error for error, _ in disturbed] == [None] * STREAMS, disturbed
        assert [text for _, text in disturbed] == [text for _, text in undisturbed]
        eventually(lambda: _routed_and_ready(cluster, namespace), 600, "group 0 back", 1)

        [victim, *_] = cluster.list("Pod", namespace, selector=f"afd.io/router={NAME}")
        with Load(url, SERVED) as load:
            time.sleep(3)
            deleted_at = time.monotonic()
            cluster.delete("Pod", victim["metadata"]["name"], namespace)
            time.sleep(15)
        later = [o for o in load.outcomes if o.at >= deleted_at + 5]
        assert later and all(o.ok for o in later), load.summary()
        assert all(o.detail for o in load.failures())  # explicit: an HTTP status or a transport error, never silence
        print(f"[router] router pod deleted under load: {load.summary()}")
        eventually(lambda: _routed_and_ready(cluster, namespace), 300, "the router back to 2 Ready pods", 1)

        with Load(url, SERVED) as load:
            time.sleep(3)
            cluster.merge_patch("AFDDeployment", NAME, namespace,
                                {"spec": {"router": {"env": [{"name": "AFD_LOG_LEVEL", "value": "DEBUG"}]}}})
            eventually(lambda: (d := cluster.get("Deployment", f"{NAME}-router", namespace))["status"].get(
                "updatedReplicas") == 2 and d["status"].get("readyReplicas") == 2
                and d["status"].get("replicas") == 2, 300, "the router rolled out", 1)
            time.sleep(5)
        assert load.outcomes and not load.failures(), load.summary()
        print(f"[router] router rollout under load: {load.summary()}")
    finally:
        release.uninstall()
        cluster.delete("Namespace", namespace)
        cluster.delete("Namespace", release.namespace)
