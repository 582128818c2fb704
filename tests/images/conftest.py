"""Fixtures of the image tests: the podman builds (opt-in with AFD_IMAGE_TESTS=1, done once per session)."""

from __future__ import annotations

import os

import pytest

from imagekit import build_images


@pytest.fixture(scope="session")
def images():
    """name → tag of the freshly built (layer-cached) runtime and operator images; skips with the reason
    when image tests are off or the tools are missing."""
    if os.environ.get("AFD_IMAGE_TESTS") != "1":
        pytest.skip("image builds are opt-in: set AFD_IMAGE_TESTS=1 (needs root, podman, mmdebstrap, runc, catatonit)")
    if missing := build_images.missing_tools():
        pytest.skip(f"AFD_IMAGE_TESTS=1 but {', '.join(missing)} not installed "
                    "(apt-get install podman mmdebstrap runc catatonit)")
    if os.geteuid() != 0:
        pytest.skip("image builds here need root (rootless podman lacks the uid mappings)")
    build_images.ensure_base()
    return {name: build_images.build(name) for name in ("operator", "runtime")}
