"""A real single-node cluster for end-to-end tests: the kit's `up.sh --node`, local images, load.

Needs AFD_KUBECONFIG (see real_cluster.py) pointing at a kit started with a node:

    ../shared/tools/kube-local/up.sh --node
    export AFD_KUBECONFIG=$HOME/.cache/afd-kube-local/kubeconfig

and podman, buildah-free `scripts/build_images.py` tools and the kit's `images-import.sh`.
Without them the tests skip with the reason (CI has no kit).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from real_cluster import ROOT, Cluster, kubeconfig_or_skip

KIT = Path(os.environ.get("AFD_KUBE_LOCAL_KIT", ROOT.parent / "shared" / "tools" / "kube-local"))
RUNTIME_IMAGE = "localhost/afd-runtime:dev"
OPERATOR_IMAGE = "localhost/afd-operator:dev"


def node_cluster_or_skip() -> Cluster:
    """The kit's cluster with a Ready node, or pytest.skip naming what is missing."""
    import pytest

    cluster = Cluster(kubeconfig_or_skip())
    nodes = cluster.call("GET", "/api/v1/nodes")["items"]
    ready = [n for n in nodes if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))]
    if not ready:
        pytest.skip("the cluster has no Ready node: start the kit with ../shared/tools/kube-local/up.sh --node")
    sys.path.insert(0, str(ROOT / "scripts"))
    import build_images

    if missing := build_images.missing_tools():
        pytest.skip(f"cannot build the images here: missing {', '.join(missing)}")
    if not (KIT / "images-import.sh").is_file():
        pytest.skip(f"no kube-local kit at {KIT} (set AFD_KUBE_LOCAL_KIT)")
    return cluster


def build_and_import_images() -> None:
    """`make images`, then the kit's import into the node's containerd."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_images.py"), "all"], check=True, cwd=ROOT)
    subprocess.run([str(KIT / "images-import.sh"), RUNTIME_IMAGE, OPERATOR_IMAGE], check=True,
                   env={**os.environ, "KUBECONFIG": os.environ["AFD_KUBECONFIG"]})


def tiny_model_on_the_host(path: Path, arch: str = "qwen3_moe") -> Path:
    """`afd make-tiny-model --arch ARCH` into a host folder the non-root role pods (uid 10001) can read."""
    if path.exists():
        shutil.rmtree(path)
    subprocess.run([str(Path(sys.executable).parent / "afd"), "make-tiny-model", "--arch", arch, "--out", str(path)],
                   check=True, capture_output=True)
    for parent in [path, *path.parents]:
        if parent == Path("/"):
            break
        parent.chmod(parent.stat().st_mode | 0o005)  # o+rx on the way down, as a hostPath user needs
    return path


def service_url(cluster: Cluster, namespace: str, name: str) -> str:
    service = cluster.get("Service", name, namespace)
    return f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"


@dataclass
class Outcome:
    at: float
    kind: str
    ok: bool
    detail: str = ""


@dataclass
class Load:
    """Closed-loop clients through the client Service: completions and streams, every outcome kept."""

    url: str
    model: str
    clients: int = 4
    max_tokens: int = 8
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> "Load":
        for index in range(self.clients):
            thread = threading.Thread(target=self._client, args=(index % 2 == 1,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def summary(self) -> str:
        failed = self.failures()
        return f"{len(self.outcomes) - len(failed)} ok, {len(failed)} failed" + (
            f" (first: {failed[0].kind} {failed[0].detail})" if failed else "")

    def _client(self, stream: bool) -> None:
        body = {"model": self.model, "prompt": "Hello there", "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        with httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0)) as client:
            while not self._stop.is_set():
                kind = "stream" if stream else "completion"
                try:
                    self.outcomes.append(Outcome(time.monotonic(), kind, *self._one(client, body, stream)))
                except httpx.HTTPError as err:
                    self.outcomes.append(Outcome(time.monotonic(), kind, False, f"{type(err).__name__}: {err}"))

    def _one(self, client: httpx.Client, body: dict, stream: bool) -> tuple[bool, str]:
        if not stream:
            response = client.post(f"{self.url}/v1/completions", json=body)
            if response.status_code != 200:
                return False, f"HTTP {response.status_code}: {response.text[:200]}"
            tokens = response.json()["usage"]["completion_tokens"]
            return tokens == self.max_tokens, f"{tokens} tokens"
        with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return False, f"HTTP {response.status_code}: {response.read()[:200]!r}"
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        if events[-1:] != ["[DONE]"]:
            return False, f"stream ended without [DONE]: {events[-2:]}"
        chunks = [json.loads(e) for e in events[:-1]]
        errors = [c["error"] for c in chunks if "error" in c]
        return (not errors and len(chunks) == self.max_tokens), (str(errors[0]) if errors else f"{len(chunks)} chunks")
