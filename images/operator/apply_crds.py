#!/usr/bin/env python3
"""`afd-apply-crds`: server-side-apply CustomResourceDefinitions and wait until they are Established.

The Helm chart's pre-install/pre-upgrade hook Job runs this in the operator image, because Helm
never upgrades a chart's `crds/` folder. It is the in-cluster equivalent of

    kubectl apply --server-side --force-conflicts -f charts/afd-operator/crds/

and uses the same field manager semantics: the applied fields are owned by `afd-crd-upgrade`,
conflicts with earlier owners (e.g. a `kubectl apply`) are forced, since the chart's CRD is the
source of truth. Credentials come from the pod's ServiceAccount (or KUBECONFIG outside a pod).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

import yaml

FIELD_MANAGER = "afd-crd-upgrade"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"


class CRDApi(Protocol):
    """The two calls of kubernetes.client.ApiextensionsV1Api that this script makes."""

    def patch_custom_resource_definition(self, name: str, body: Any, **kwargs: Any) -> Any: ...

    def read_custom_resource_definition(self, name: str, **kwargs: Any) -> Any: ...


def load_crds(directory: Path) -> list[dict]:
    """Every CustomResourceDefinition in the *.yaml/*.yml files of `directory` (sorted by file name)."""
    files = sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    crds = []
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            if doc.get("kind") != "CustomResourceDefinition":
                raise ValueError(f"{path}: expected only CustomResourceDefinitions, found kind {doc.get('kind')!r}")
            crds.append(doc)
    if not crds:
        raise ValueError(f"{directory}: no CustomResourceDefinition found in *.yaml files")
    return crds


def is_established(crd: dict) -> bool:
    """True when the API server reports the CRD Established (its resources are served)."""
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def apply_crds(api: CRDApi, crds: Iterable[dict], timeout: float = 120.0,
               sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
               log: Callable[[str], None] = print) -> None:
    """Server-side-apply each CRD, then wait (up to `timeout` s in all) until all are Established.

    Raises TimeoutError naming the CRDs that are not Established in time.
    """
    names = []
    for crd in crds:
        name = crd["metadata"]["name"]
        api.patch_custom_resource_definition(
            name, crd, field_manager=FIELD_MANAGER, force=True, _content_type=APPLY_CONTENT_TYPE
        )
        log(f"applied customresourcedefinition/{name} (server-side, field manager {FIELD_MANAGER})")
        names.append(name)
    deadline = clock() + timeout
    waiting = list(names)
    while True:
        waiting = [n for n in waiting if not is_established(_read(api, n))]
        if not waiting:
            log(f"established: {', '.join(names)}")
            return
        if clock() >= deadline:
            raise TimeoutError(f"not Established after {timeout:g}s: {', '.join(waiting)} "
                               f"(see `kubectl describe crd {waiting[0]}`)")
        sleep(1.0)


def _read(api: CRDApi, name: str) -> dict:
    """The CRD as plain JSON (skips the client's model classes, which drop unknown fields)."""
    response = api.read_custom_resource_definition(name, _preload_content=False)
    data = getattr(response, "data", response)
    return json.loads(data) if isinstance(data, (bytes, str)) else data


def _kube_api() -> CRDApi:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiextensionsV1Api()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="afd-apply-crds", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/crds", type=Path, help="folder of CRD YAML files (default /crds)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for Established (default 120)")
    args = parser.parse_args(argv)
    try:
        crds = load_crds(args.dir)
        apply_crds(_kube_api(), crds, args.timeout)
    except Exception as err:  # the Job's log is the only place a user sees this: say what failed
        print(f"afd-apply-crds: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
