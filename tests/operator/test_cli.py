"""`python -m afd_operator`: help, render without a cluster, clear errors."""

from __future__ import annotations

import base64
import subprocess
import sys

import yaml

from afd_operator.cli import main, render_file
from op_testkit import GOLDEN, ROOT, make_cr


def test_module_help_runs_without_torch():
    result = subprocess.run([sys.executable, "-c", "import sys, runpy; sys.argv=['afd_operator','--help'];"
                             "\ntry: runpy.run_module('afd_operator', run_name='__main__')\nexcept SystemExit as e: "
                             "assert e.code == 0\nassert 'torch' not in sys.modules"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "render" in result.stdout and "run" in result.stdout


def test_the_operator_never_imports_torch():
    code = ("import sys, afd_operator.handlers, afd_operator.cli, afd_operator.reconcile.deployment;"
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_render_matches_the_golden_file_for_the_sample():
    text = render_file(str(ROOT / "crds/samples/gpu-nccl-dsv2-lite.yaml"), namespace="ns")
    objs = list(yaml.safe_load_all(text))
    [secret] = [o for o in objs if o["kind"] == "Secret"]  # what the operator creates once, by itself
    assert secret["metadata"]["name"] == "dsv2-lite-group-secret" and secret["immutable"] is True
    assert len(bytes.fromhex(base64.b64decode(secret["data"]["group-secret"]).decode())) == 32
    objs = [o for o in objs if o["kind"] != "Secret"]
    golden = list(yaml.safe_load_all((GOLDEN / "1g-4a2f-nccl.yaml").read_text()))
    strip = lambda o: {**o, "metadata": {k: v for k, v in o["metadata"].items() if k != "ownerReferences"}}
    assert [strip(o) for o in objs] == [strip(o) for o in golden]  # same objects; the uid is a placeholder


def test_render_reports_bad_specs_clearly(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(make_cr(attention={"ranks": 2}, ffn={"ranks": 3})))
    assert main(["render", "-f", str(path)]) == 2
    assert "ffn.ranks (3) must not exceed attention.ranks (2)" in capsys.readouterr().err


def test_run_help(capsys):
    try:
        main(["run", "--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    out = capsys.readouterr().out
    assert "--namespace" in out and "--peering" in out


def test_render_with_autoscaling_shows_the_groups_the_operator_starts_with(tmp_path):
    """spec.replicas 1 with minGroups 2: the operator starts with 2 groups, and so does render."""
    body = yaml.safe_load((ROOT / "crds/samples/cpu-zmq-tiny-autoscaling.yaml").read_text())
    body["spec"]["autoscaling"]["minGroups"] = 2
    path = tmp_path / "cr.yaml"
    path.write_text(yaml.safe_dump(body))
    names = {o["metadata"]["name"] for o in yaml.safe_load_all(render_file(str(path), namespace="ns"))
             if o and o["kind"] == "StatefulSet"}
    assert names == {f"tiny-cpu-autoscaled-g{g}-{role}" for g in (0, 1) for role in ("attn", "ffn")}
