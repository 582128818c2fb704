"""images/operator/apply_crds.py (`afd-apply-crds`, the chart's CRD upgrade hook) against a fake API."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("apply_crds", ROOT / "images" / "operator" / "apply_crds.py")
apply_crds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(apply_crds)


class FakeResponse:
    def __init__(self, body: dict):
        self.data = json.dumps(body).encode()


class FakeApi:
    """Records applies; a CRD turns Established after `established_after` reads."""

    def __init__(self, established_after: int = 1):
        self.applied: list[tuple[str, dict, dict]] = []
        self.reads: dict[str, int] = {}
        self.established_after = established_after

    def patch_custom_resource_definition(self, name, body, **kwargs):
        self.applied.append((name, body, kwargs))

    def read_custom_resource_definition(self, name, **kwargs):
        assert kwargs == {"_preload_content": False}
        self.reads[name] = self.reads.get(name, 0) + 1
        status = "True" if self.reads[name] >= self.established_after else "False"
        return FakeResponse({"metadata": {"name": name},
                             "status": {"conditions": [{"type": "NamesAccepted", "status": "True"},
                                                       {"type": "Established", "status": status}]}})


def chart_crds(tmp_path: Path) -> Path:
    folder = tmp_path / "crds"
    shutil.copytree(ROOT / "charts" / "afd-operator" / "crds", folder)
    return folder


def test_server_side_applies_every_chart_crd_with_force_and_waits_for_established(tmp_path):
    crds = apply_crds.load_crds(chart_crds(tmp_path))
    assert [c["metadata"]["name"] for c in crds] == ["afddeployments.afd.io"]
    api, slept, logs = FakeApi(established_after=3), [], []
    apply_crds.apply_crds(api, crds, timeout=30, sleep=slept.append, clock=lambda: 0.0, log=logs.append)
    ((name, body, kwargs),) = api.applied
    assert name == "afddeployments.afd.io" and body == crds[0]
    assert kwargs == {"field_manager": "afd-crd-upgrade", "force": True, "_content_type": "application/apply-patch+yaml"}
    assert api.reads[name] == 3 and slept == [1.0, 1.0]
    assert logs[-1] == "established: afddeployments.afd.io"


def test_times_out_naming_the_crd_that_is_not_established(tmp_path):
    crds = apply_crds.load_crds(chart_crds(tmp_path))
    now = iter(range(0, 1000, 10))
    with pytest.raises(TimeoutError, match="not Established after 30s: afddeployments.afd.io"):
        apply_crds.apply_crds(FakeApi(established_after=10**6), crds, timeout=30, sleep=lambda s: None,
                              clock=lambda: float(next(now)), log=lambda m: None)


def test_refuses_a_folder_without_crds_or_with_other_kinds(tmp_path):
    with pytest.raises(ValueError, match="no CustomResourceDefinition"):
        apply_crds.load_crds(tmp_path)
    (tmp_path / "x.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(ValueError, match="expected only CustomResourceDefinitions, found kind 'ConfigMap'"):
        apply_crds.load_crds(tmp_path)


def test_cli_reports_failures_in_one_line(tmp_path, capsys):
    assert apply_crds.main(["--dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("afd-apply-crds: ValueError: ")


def test_real_kubernetes_client_sends_a_forced_server_side_apply(tmp_path):
    """The request the real kubernetes client makes, seen by a local HTTP stand-in for the API server."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kubernetes import client

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PATCH(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.command, self.path, self.headers["Content-Type"], body))
            self._reply(body)

        def do_GET(self):  # noqa: N802
            seen.append((self.command, self.path, None, None))
            self._reply({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                         "metadata": {"name": "afddeployments.afd.io"},
                         "status": {"conditions": [{"type": "Established", "status": "True"}]}})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
        api = client.ApiextensionsV1Api(client.ApiClient(config))
        crds = apply_crds.load_crds(chart_crds(tmp_path))
        apply_crds.apply_crds(api, crds, timeout=5, log=lambda m: None)
    finally:
        server.shutdown()
    (method, path, content_type, body), (get, get_path, _, _) = seen
    assert method == "PATCH" and content_type == "application/apply-patch+yaml"
    assert path == ("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/afddeployments.afd.io"
                    "?fieldManager=afd-crd-upgrade&force=true")
    assert body == crds[0]
    assert get == "GET" and get_path == "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/afddeployments.afd.io"
