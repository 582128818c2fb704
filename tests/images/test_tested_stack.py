"""The tested stack (images/tested_stack.env) is the one the runtime image's default base, its README, the GPU
scripts and the tuned kernel tables name: a change to one without the others fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STACK_FILE = ROOT / "images" / "tested_stack.env"
KEYS = {"TESTED_TORCH", "TESTED_TRITON", "TESTED_CUDA", "RUNTIME_BASE_IMAGE"}


def read_stack(text: str) -> dict[str, str]:
    """KEY=VALUE lines of the stack file (comments and blank lines skipped; no quotes: bash sources it as is)."""
    stack = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Z_]+", key) or not re.fullmatch(r"[\w.:/@-]+", value):
            raise ValueError(f"{STACK_FILE.name}: not a plain KEY=VALUE line: {line!r}")
        stack[key] = value
    return stack


@pytest.fixture(scope="module")
def stack() -> dict[str, str]:
    return read_stack(STACK_FILE.read_text())


def dockerfile_default_base() -> str:
    match = re.search(r"(?m)^ARG BASE_IMAGE=(\S+)$", (ROOT / "images" / "runtime" / "Dockerfile").read_text())
    assert match, "images/runtime/Dockerfile has no ARG BASE_IMAGE default"
    return match.group(1)


def test_the_stack_file_names_every_key_once(stack):
    assert set(stack) == KEYS
    for key in ("TESTED_TORCH", "TESTED_TRITON", "TESTED_CUDA"):
        assert re.fullmatch(r"\d+\.\d+(\.\d+)?", stack[key]), key


def test_the_runtime_image_default_base_is_the_tested_stack(stack):
    base = dockerfile_default_base()
    assert base == stack["RUNTIME_BASE_IMAGE"], "the Dockerfile's BASE_IMAGE default and images/tested_stack.env part"
    tag = re.fullmatch(r"(?:docker\.io/)?pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-runtime", base)
    assert tag, f"{base}: not a pytorch/pytorch CUDA runtime tag (its torch and CUDA are read from the tag)"
    assert (tag.group(1), tag.group(2)) == (stack["TESTED_TORCH"], stack["TESTED_CUDA"])


def test_the_images_readme_documents_the_same_stack(stack):
    readme = (ROOT / "images" / "README.md").read_text()
    row = re.search(r"(?m)^\| runtime \| `BASE_IMAGE` \| `([^`]+)` \|", readme)
    assert row and row.group(1) == stack["RUNTIME_BASE_IMAGE"]
    assert f"torch {stack['TESTED_TORCH']}" in readme and f"Triton {stack['TESTED_TRITON']}" in readme


def test_the_gpu_scripts_check_the_machine_against_the_stack_file():
    env = (ROOT / "bench" / "gpu_env.sh").read_text()
    assert "source images/tested_stack.env" in env
    assert '"$TESTED_TORCH" "$TESTED_TRITON"' in env  # both versions handed to the check
    for script in sorted((ROOT / "bench").glob("run_gpu*.sh")):
        assert "source bench/gpu_env.sh" in script.read_text(), f"{script.name} skips the stack check"


def test_every_tuned_table_was_tuned_on_the_tested_stack(stack):
    tables = sorted((ROOT / "runtime" / "afd" / "kernels" / "configs").glob("*.json"))
    assert tables
    for table in tables:
        document = json.loads(table.read_text())
        assert document["torch"].split("+")[0] == stack["TESTED_TORCH"], table.name
        if "triton" in document:  # tables tuned since the tuner records Triton's version
            assert document["triton"] == stack["TESTED_TRITON"], table.name


def test_read_stack_refuses_quotes_and_stray_lines():
    assert read_stack("# c\n\nA_B=1.2\n") == {"A_B": "1.2"}
    for bad in ('TESTED_TORCH="2.11.0"\n', "not a line\n", "lower=1\n"):
        with pytest.raises(ValueError):
            read_stack(bad)
