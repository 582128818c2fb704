"""The operator image against a kmock API server (opt-in with the other image tests: AFD_IMAGE_TESTS=1).

The closest thing to `helm install` on a fresh cluster that this machine can run: the operator
container gets exactly the args the chart renders, reaches the API through a kubeconfig, answers
kopf's health endpoint that the chart probes, and turns an AFDDeployment into StatefulSets. The
chart's CRD upgrade hook command (`afd-apply-crds`) applies the chart's CRD and waits until it is
Established. The containers use the host network to reach kmock on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "operator"), str(ROOT / "tests" / "charts")]
from chartkit import one, render_objects  # noqa: E402
from kmock_cluster import CR_PATH, NS, ApplyingEmulator, eventually, get, items, register, send  # noqa: E402
from op_testkit import make_cr  # noqa: E402

del sys.path[:2]
from imagekit import build_images, free_port  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(900), pytest.mark.kmock(cls=ApplyingEmulator)]
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def kubeconfig(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url.rstrip("/")}}],
        "users": [{"name": "kmock", "user": {"token": "kmock-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NS}}],
    }))
    path.chmod(0o644)  # read by the image's uid 10001
    return path


async def podman(*args: str, check: bool = True):
    return await asyncio.to_thread(build_images.podman, *args, check=check, capture=True)


def healthz(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


async def test_operator_image_with_the_charts_args_reconciles_and_answers_its_probe(images, kmock, tmp_path):
    register(kmock)
    port = free_port()
    container = one(render_objects({"healthPort": port, "operator": {"resyncSeconds": 1}}), "Deployment")
    args = container["spec"]["template"]["spec"]["containers"][0]["args"]
    name = f"afd-op-{uuid.uuid4().hex[:8]}"
    # `python -m afd_operator run` is the image's operator with the entrypoint's arguments; the
    # `afd operator` entrypoint itself is tested in test_image_smoke.
    await podman("run", "-d", "--name", name, "--network", "host", "--read-only", "--tmpfs", "/tmp",
                 "-v", f"{kubeconfig(tmp_path, str(kmock.url))}:/kube/config:ro", "-e", "KUBECONFIG=/kube/config",
                 "--entrypoint", "python3", images["operator"], "-m", "afd_operator", "run", *args)

    async def logs() -> str:
        return (await podman("logs", name, check=False)).stderr[-4000:]

    try:
        try:
            await eventually(lambda: asyncio.to_thread(healthz, f"http://127.0.0.1:{port}/healthz"), timeout=60, interval=0.5)
        except AssertionError:
            pytest.fail(f"kopf's /healthz (the chart's probes) never answered 200:\n{await logs()}")
        body = make_cr(attention={"ranks": 2}, ffn={"ranks": 1})
        body["metadata"]["resourceVersion"] = "1"
        await send(kmock, "POST", CR_PATH, body)
        try:
            sts = await eventually(lambda: items(kmock, f"/apis/apps/v1/namespaces/{NS}/statefulsets"), timeout=60, interval=0.5)
        except AssertionError:
            pytest.fail(f"the operator in the image created no StatefulSet:\n{await logs()}")
        assert sorted(s["metadata"]["name"] for s in sts) == ["demo-g0-attn", "demo-g0-ffn"]
    finally:
        await podman("rm", "-f", "-t", "10", name, check=False)


async def test_crd_upgrade_hook_command_applies_the_charts_crd_and_waits_for_established(images, kmock, tmp_path):
    register(kmock)
    hook = [o for o in render_objects() if o["kind"] == "Job"][0]
    spec = hook["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    config_map = next(o for o in render_objects() if o["kind"] == "ConfigMap" and "crd-upgrade" in o["metadata"]["name"])
    crds = tmp_path / "crds"
    crds.mkdir(mode=0o755)
    for key, text in config_map["data"].items():  # what the Job's ConfigMap volume mounts at /crds
        (crds / key).write_text(text)
        (crds / key).chmod(0o644)
    crds.chmod(0o755)
    tmp_path.chmod(0o755)
    name = f"afd-crd-{uuid.uuid4().hex[:8]}"
    await podman("run", "-d", "--name", name, "--network", "host", "--read-only", "--tmpfs", "/tmp",
                 "-v", f"{kubeconfig(tmp_path, str(kmock.url))}:/kube/config:ro", "-e", "KUBECONFIG=/kube/config",
                 "-v", f"{crds}:/crds:ro", "--entrypoint", container["command"][0], images["operator"], *container["args"])
    try:
        crd_name = yaml.safe_load(next(iter(config_map["data"].values())))["metadata"]["name"]
        applied = await eventually(lambda: get(kmock, f"{CRD_PATH}/{crd_name}"), timeout=60, interval=0.5)
        assert applied["spec"] == yaml.safe_load((ROOT / "crds" / "afd.io_afddeployments.yaml").read_text())["spec"]
        # what the API server does once the CRD's resources are served:
        await send(kmock, "PATCH", f"{CRD_PATH}/{crd_name}",
                   {"status": {"conditions": [{"type": "Established", "status": "True"}]}})
        exit_code = (await podman("wait", name)).stdout.strip()
        out = await podman("logs", name, check=False)
        assert exit_code == "0", out.stdout + out.stderr
        assert f"established: {crd_name}" in out.stdout
    finally:
        await podman("rm", "-f", "-t", "5", name, check=False)
