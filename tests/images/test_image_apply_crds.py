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
