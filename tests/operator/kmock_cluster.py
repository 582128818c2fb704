"""A kmock-based stand-in for a Kubernetes API server, with the few behaviours the
operator relies on that kmock does not emulate: server-side apply creates missing
objects, and a fake StatefulSet controller + kubelet that makes pods."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any, Callable

import aiohttp.web
import kmock
from kmock._internal import enums

NS = "ns"
CR_PATH = f"/apis/afd.io/v1alpha1/namespaces/{NS}/afddeployments"
VERBS = ["get", "list", "watch", "create", "patch", "update", "delete"]
RESOURCES = {
    "afd.io/v1alpha1/afddeployments": ("AFDDeployment", True, ["status", "scale"]),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, []),
    "v1/namespaces": ("Namespace", False, []),
    "v1/pods": ("Pod", True, []),
    "v1/services": ("Service", True, []),
    "v1/configmaps": ("ConfigMap", True, []),
    "v1/secrets": ("Secret", True, []),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, []),
    "v1/events": ("Event", True, []),
    "apps/v1/statefulsets": ("StatefulSet", True, []),
    "apps/v1/deployments": ("Deployment", True, []),
}


class ApplyingEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus server-side apply semantics: an apply patch creates the object
    when it does not exist (kmock answers 404 to any patch of a missing object)."""

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):  # e.g. kopf's events
                self._generated = getattr(self, "_generated", 0) + 1
                meta["name"] = f"{meta['generateName']}{self._generated:05d}"
        is_apply = request.headers.get("Content-Type", "").startswith("application/apply-patch")
        if request.action == enums.action.UPDATE and is_apply and request.resource is not None:
            key = (request.resource, request.namespace, request.name)
            async with self._lock:
                missing = key not in self._objects or self._objects[key].deleted
                if missing:
                    if key in self._objects:
                        self._objects[key].create(request.data)
                    else:
                        self._objects[key] = request.data
                    await self._buses[request.resource].put({"type": "ADDED", "object": request.data})
            if missing:
                return aiohttp.web.json_response(request.data, status=201)
        return await super()._handle(request)


def register(server: Any) -> None:
    for key, (kind, namespaced, subresources) in RESOURCES.items():
        server.resources[key] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=VERBS, subresources=subresources)


def write_kubeconfig(path: Path, url: str) -> Path:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url.rstrip("/")}}],
        "users": [{"name": "kmock", "user": {"token": "kmock-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NS}}],
    }
    path.write_text(json.dumps(config))
    return path


async def get(server: Any, path: str) -> Any:
    async with server.get(path) as response:
        if response.status == 404:
            return None
        response.raise_for_status()
        return await response.json()


async def items(server: Any, path: str) -> list[dict]:
    listing = await get(server, path)
    return [] if listing is None else listing["items"]


async def send(server: Any, method: str, path: str, body: Any = None) -> Any:
    async with server.request(method, path, json=body) as response:
        response.raise_for_status()
        return await response.json()


async def eventually(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Await `check()` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {check}")
        await asyncio.sleep(interval)


def now_text() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def run_statefulsets(server: Any, ready: bool = True, ips: bool = False) -> list[str]:
    """What the StatefulSet controller and the kubelets would do: create every missing pod
    from its StatefulSet's template (Running, and Ready if asked; with a pod IP if asked: the
    n-th pod created gets 10.9.0.n). Returns created names."""
    created = []
    pods = {p["metadata"]["name"] for p in await items(server, f"/api/v1/namespaces/{NS}/pods")}
    for sts in await items(server, f"/apis/apps/v1/namespaces/{NS}/statefulsets"):
        for ordinal in range(sts["spec"]["replicas"]):
            name = f"{sts['metadata']['name']}-{ordinal}"
            if name in pods:
                continue
            template = sts["spec"]["template"]
            pod = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}-{time.monotonic_ns()}",
                             "labels": dict(template["metadata"]["labels"]), "creationTimestamp": now_text()},
                "spec": template["spec"],
                "status": {"phase": "Running",
                           "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                           "containerStatuses": [{"name": "main", "restartCount": 0, "ready": ready}]},
            }
            if ips:
                pod["status"]["podIP"] = f"10.9.{len(pods) // 250}.{len(pods) % 250 + 1}"
                pods.add(name)
            await send(server, "POST", f"/api/v1/namespaces/{NS}/pods", pod)
            created.append(name)
    return created
