"""Build both images with podman and smoke-test them (opt-in: AFD_IMAGE_TESTS=1).

Slow (a cold build is about 3 minutes here, a warm one about 1) and needs root with Debian's
podman, mmdebstrap and runc (catatonit for its pod), so it runs only when AFD_IMAGE_TESTS=1 (CI sets it); it
skips with the reason otherwise. scripts/build_images.py does the building; see its docstring.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
import uuid

import pytest

from imagekit import build_images, free_port  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def run(image: str, *args: str, entrypoint: str | None = None, options: tuple[str, ...] = (),
        timeout: float = 120) -> subprocess.CompletedProcess:
    """`podman run --rm --read-only` (as the chart and the operator run them: read-only root)."""
    cmd = ["run", "--rm", "--read-only", "--tmpfs", "/tmp", *options]
    if entrypoint:
        cmd += ["--entrypoint", entrypoint]
    return build_images.podman(*cmd, image, *args, check=False, capture=True, timeout=timeout)


def http(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, json.loads(response.read())


def wait_healthy(url: str, deadline_s: float, logs) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if http(url, timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"{url} not healthy after {deadline_s:.0f}s:\n{logs()}")


# --- operator image -------------------------------------------------------------------------------

def test_operator_image_runs_afd_operator_help_as_non_root(images):
    result = run(images["operator"], "--help")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--liveness" in result.stdout and "--namespace" in result.stdout
    assert run(images["operator"], entrypoint="id").stdout.startswith("uid=10001(afd)")


def test_operator_image_has_the_crd_upgrade_tool_and_no_torch(images):
    result = run(images["operator"], "--help", entrypoint="afd-apply-crds")
    assert result.returncode == 0 and "--dir" in result.stdout, result.stderr
    result = run(images["operator"], "-c", "import afd_operator.handlers, kopf, kubernetes; import torch",
                 entrypoint="python3")
    assert "No module named 'torch'" in result.stderr, result.stderr


def test_operator_image_module_entrypoint_knows_the_charts_flags(images):
    """`python -m afd_operator run` (the fallback entrypoint) is in the image with the chart's flags."""
    result = run(images["operator"], "-m", "afd_operator", "run", "--help", entrypoint="python3")
    assert result.returncode == 0, result.stderr
    assert all(flag in result.stdout for flag in ("--liveness", "--namespace", "--peering", "--resync-seconds"))


# --- runtime image --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(images, tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    folder.chmod(0o777)  # written by the image's uid 10001
    result = run(images["runtime"], "make-tiny-model", "--arch", "qwen3_moe", "--out", "/models/tiny",
                 options=("-v", f"{folder}:/models"))
    assert result.returncode == 0, result.stderr
    return folder


def test_runtime_image_prints_afd_help_as_non_root(images):
    result = run(images["runtime"], "--help")
    assert result.returncode == 0, result.stderr
    assert all(cmd in result.stdout for cmd in ("serve", "up", "generate", "make-tiny-model"))
    tools = run(images["runtime"], "-c", "command -v afd; command -v hf; command -v gcc cc || true; id -u", entrypoint="sh")
    assert tools.stdout.split() == ["/opt/afd/bin/afd", "/opt/afd/bin/hf", "10001"], tools.stdout  # no compiler


def test_runtime_image_serves_both_roles_from_afd_env_through_a_published_port(images, tiny_model):
    """Like one AFD group of the operator: an FFN pod and an attention pod, each `afd serve` with only
    AFD_* env (docs/configuration.md), read-only root; here both in one podman pod, the API on a published port."""
    pod, port = f"afd-smoke-{uuid.uuid4().hex[:8]}", free_port()
    env = {"AFD_NUM_ATTENTION_RANKS": "1", "AFD_NUM_FFN_RANKS": "1", "AFD_RANK": "0", "AFD_MODEL": "/models/tiny",
           "AFD_CONNECTOR": "zmq", "AFD_FFN_ADDRESS_TEMPLATE": "127.0.0.1", "AFD_DEVICE": "cpu",
           "AFD_HTTP_PORT": "8000", "AFD_SERVED_MODEL_NAME": "tiny"}
    build_images.podman("pod", "create", "--name", pod, "-p", f"127.0.0.1:{port}:8000", capture=True)
    try:
        for role, metrics in (("ffn", "9091"), ("attention", "9090")):
            env_args = [a for k, v in {**env, "AFD_ROLE": role, "AFD_METRICS_PORT": metrics}.items() for a in ("-e", f"{k}={v}")]
            build_images.podman("run", "-d", "--pod", pod, "--name", f"{pod}-{role}", "--read-only", "--tmpfs", "/tmp",
                                "-v", f"{tiny_model}:/models:ro", *env_args, images["runtime"], capture=True)

        def logs() -> str:
            return "\n".join(build_images.podman("logs", f"{pod}-{r}", check=False, capture=True).stderr[-3000:]
                             for r in ("ffn", "attention"))

        wait_healthy(f"http://127.0.0.1:{port}/health", 180, logs)
        status, models = http(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
        status, out = http(f"http://127.0.0.1:{port}/v1/completions",
                           {"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0})
        assert status == 200 and out["usage"]["completion_tokens"] == 5, out
        assert out["choices"][0]["finish_reason"] == "length"
    finally:
        build_images.podman("pod", "rm", "-f", "-t", "2", pod, check=False, capture=True)


def test_runtime_image_serves_afd_up_on_the_tiny_model(images, tiny_model):
    """`afd up` binds its URL to 127.0.0.1 inside the container, so it runs on the host network here."""
    name, port = f"afd-up-{uuid.uuid4().hex[:8]}", free_port()
    build_images.podman("run", "-d", "--name", name, "--network", "host", "--read-only", "--tmpfs", "/tmp",
                        "-v", f"{tiny_model}:/models:ro", images["runtime"], "up", "--model", "/models/tiny",
                        "--port", str(port), "--topology", "2A1F", "--no-demo", capture=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", 240,
                     lambda: build_images.podman("logs", name, check=False, capture=True).stderr[-3000:])
        status, out = http(f"http://127.0.0.1:{port}/v1/completions",
                           {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert status == 200 and out["usage"]["completion_tokens"] == 4, out
    finally:
        build_images.podman("rm", "-f", "-t", "5", name, check=False, capture=True)
