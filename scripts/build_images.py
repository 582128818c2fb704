#!/usr/bin/env python3
"""Build the AFD images locally with podman, on a machine without a container registry.

    python scripts/build_images.py base               # make localhost/afd-base:bookworm (mmdebstrap + podman import)
    python scripts/build_images.py build runtime      # images/runtime/Dockerfile -> localhost/afd-runtime:dev
    python scripts/build_images.py build operator     # images/operator/Dockerfile -> localhost/afd-operator:dev
    python scripts/build_images.py all                # all three

No registry is reachable here, so the base image is a Debian bookworm root filesystem with
python3, made by `mmdebstrap` and imported with `podman import`, and passed to the Dockerfiles
through their BASE_IMAGE build argument with `--pull=never`. pip inside the build reaches PyPI
with the host's CA bundle (mounted into the build) and the host's local wheel folder
(/opt/wheels, where the CPU torch wheel lies). The build context is a clean copy of the files
the images need, never the whole checkout (.venv alone is gigabytes).

Needs, as root: Debian's podman, mmdebstrap (and runc: crun fails on cgroups here); catatonit for podman pods.
Missing ones are installed with apt-get first where apt-get is there and this runs as root (as .ci/run does;
--no-install: never); elsewhere it stops with the command that installs them.
Builds are cached by podman's layer cache; the base image is made once per machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_TAG = "localhost/afd-base:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = "python3,python3-venv,ca-certificates,passwd"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
HOST_WHEELS = Path("/opt/wheels")
CPU_TORCH = "torch==2.13.0"  # the CPU wheel in /opt/wheels (the Makefile's TORCH_VERSION)
CONTEXT_PATHS = ["pyproject.toml", "README.md", "runtime", "operator", "images"]
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache")


def image_tag(name: str) -> str:
    return f"localhost/afd-{name}:dev"


def containers_conf() -> Path:
    """A containers.conf for podman here: the runc runtime (crun cannot set up cgroups on these
    machines), and default ulimits no higher than this sandbox's hard limits (podman's defaults
    are higher, and runc may not raise them: 'error setting rlimit ... operation not permitted')."""
    _, nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    _, nproc = resource.getrlimit(resource.RLIMIT_NPROC)
    nofile = 1048576 if nofile == resource.RLIM_INFINITY else nofile
    nproc = 8192 if nproc == resource.RLIM_INFINITY else min(nproc, 8192)
    path = Path(tempfile.gettempdir()) / "afd-containers.conf"
    path.write_text("[containers]\n"
                    f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
                    "[engine]\n"
                    'runtime = "runc"\n')
    return path


def podman(*args: str, check: bool = True, capture: bool = False, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run podman with this machine's containers.conf (see `containers_conf`)."""
    env = {**os.environ, "CONTAINERS_CONF": str(containers_conf())}
    result = subprocess.run(["podman", *args], text=True, timeout=timeout, capture_output=capture, env=env)
    if check and result.returncode:
        detail = f": {result.stderr.strip()[-2000:]}" if capture and result.stderr else ""
        raise RuntimeError(f"`podman {' '.join(args)}` exited {result.returncode}{detail}")
    return result


# Debian packages of each tool, with what podman needs here besides (.ci/run installs the same)
TOOL_PACKAGES = {"podman": ["podman", "catatonit", "uidmap", "fuse-overlayfs"], "mmdebstrap": ["mmdebstrap"],
                 "runc": ["runc"]}


def missing_tools() -> list[str]:
    """Tools this script needs that are not on PATH (empty when it can run)."""
    return [tool for tool in TOOL_PACKAGES if shutil.which(tool) is None]


def install_command(missing: list[str]) -> list[str]:
    """The apt-get command that installs the packages of the `missing` tools."""
    packages = [package for tool in missing for package in TOOL_PACKAGES[tool]]
    return ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]


def can_install() -> bool:
    """apt-get is there and we are root: missing tools can be installed as .ci/run installs them."""
    return shutil.which("apt-get") is not None and os.geteuid() == 0


def ensure_tools(install: bool = True) -> list[str]:
    """Install the missing tools with apt-get when `install` and `can_install()`; returns those still missing."""
    missing = missing_tools()
    if missing and install and can_install():
        print(f"missing: {', '.join(missing)}; installing: {' '.join(install_command(missing))}", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
        subprocess.run(install_command(missing), check=True, env=env)
        missing = missing_tools()
    return missing


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def ensure_base(force: bool = False) -> str:
    """Make the local Debian base image unless it exists; returns its tag."""
    if image_exists(BASE_TAG) and not force:
        return BASE_TAG
    with tempfile.TemporaryDirectory(prefix="afd-base-") as tmp:
        tar = Path(tmp) / "rootfs.tar"
        subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={BASE_PACKAGES}",
                        "bookworm", str(tar), DEBIAN_MIRROR], check=True)
        podman("import", "--change", 'CMD ["/bin/bash"]', str(tar), BASE_TAG, capture=True)
    return BASE_TAG


def make_context(dest: Path) -> Path:
    """Copy what the Dockerfiles COPY into `dest` (a clean build context)."""
    for rel in CONTEXT_PATHS:
        src = ROOT / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel, ignore=IGNORED)
        else:
            shutil.copy2(src, dest / rel)
    return dest


def build(name: str, base: str = BASE_TAG, tag: str | None = None, network: str | None = None) -> str:
    """Build images/<name>/Dockerfile on `base`; returns the image tag. `network`: podman build's
    --network for the RUN steps (e.g. `host` where podman's default 10.88.0.0/16 collides with a
    cluster's pod range, or gives the build no DNS)."""
    tag = tag or image_tag(name)
    args = ["build", "--pull=never", "--layers", "-f", f"images/{name}/Dockerfile", "-t", tag,
            "--build-arg", f"BASE_IMAGE={base}"]
    if network:
        args.append(f"--network={network}")
    if HOST_CA.exists():  # pip behind this network's TLS proxy needs the host's CA bundle
        args += ["-v", f"{HOST_CA}:/etc/ssl/certs/afd-host-ca.crt:ro",
                 "--build-arg", "PIP_CERT=/etc/ssl/certs/afd-host-ca.crt"]
    if HOST_WHEELS.is_dir():
        args += ["-v", f"{HOST_WHEELS}:/opt/wheels:ro", "--build-arg", "PIP_FIND_LINKS=/opt/wheels"]
    if name == "runtime":
        args += ["--build-arg", f"TORCH_SPEC={CPU_TORCH}"]
    previous = podman("image", "inspect", "--format", "{{.Id}}", tag, check=False, capture=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix=f"afd-{name}-ctx-") as tmp:
        context = make_context(Path(tmp))
        podman(*args, str(context))
    current = podman("image", "inspect", "--format", "{{.Id}}", tag, capture=True).stdout.strip()
    if previous and previous != current:  # the replaced image (about 1 GB for runtime) would pile up
        podman("rmi", previous, check=False, capture=True)
    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["base", "build", "all"])
    parser.add_argument("name", nargs="?", choices=["runtime", "operator"])
    parser.add_argument("--force-base", action="store_true", help="remake the base image")
    parser.add_argument("--network", help="network of the build's RUN steps (podman build --network), e.g. host")
    parser.add_argument("--no-install", action="store_true", help="never install missing tools with apt-get")
    args = parser.parse_args(argv)
    try:
        missing = ensure_tools(install=not args.no_install)
    except subprocess.CalledProcessError as err:
        print(f"error: installing the tools failed: `{' '.join(err.cmd)}` exited {err.returncode}", file=sys.stderr)
        return 2
    if missing:
        how = "as root" if shutil.which("apt-get") else "on Debian or Ubuntu, as root"
        print(f"missing: {', '.join(missing)} (install them, {how}: {' '.join(install_command(missing))})",
              file=sys.stderr)
        return 2
    os.chdir(ROOT)
    start = time.monotonic()
    base = ensure_base(args.force_base)
    print(f"{base} ready ({time.monotonic() - start:.0f}s)")
    names = {"base": [], "build": [args.name] if args.name else [], "all": ["operator", "runtime"]}[args.what]
    if args.what == "build" and not args.name:
        parser.error("build needs runtime or operator")
    for name in names:
        step = time.monotonic()
        print(f"built {build(name, network=args.network)} ({time.monotonic() - step:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
