"""Fixtures of the operator tests."""

from __future__ import annotations

from typing import Any

import pytest

from op_testkit import load_crd


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return load_crd()
