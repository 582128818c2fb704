"""What the tests against a real kube-apiserver share (issue 14): the cluster, the CRD applied, namespaces
made and deleted per test, a sample in a namespace, kubectl.

kmock validates nothing; these tests run what only a real API server does: the CRD's own validation (CEL
rules against defaults, cost estimates), OpenAPI and CEL validation of custom resources, defaulting,
server-side apply, RBAC, the StatefulSet and garbage collectors. By subject:
test_real_apiserver_crd.py (the CRD and custom resources), test_real_apiserver_chart.py (the chart),
test_real_apiserver_operator.py (the operator under its own ServiceAccount).

They need the kit's control plane (../shared/tools/kube-local/up.sh) and AFD_KUBECONFIG pointing at its
kubeconfig; without it they skip (see real_cluster.py). A test module takes the fixtures by importing them:
each module gets its own (module-scoped) cluster and CRD, so a module runs alone as well as after another.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from op_testkit import CRD_PATH, SAMPLES
from real_cluster import Cluster, kubeconfig_or_skip

CRD_NAME = "afddeployments.afd.io"


@pytest.fixture(scope="module")
def cluster():
    return Cluster(kubeconfig_or_skip())


@pytest.fixture(scope="module")
def crd(cluster):
    """The canonical CRD, applied server-side (the chart's copy is the same file)."""
    cluster.apply(yaml.safe_load(CRD_PATH.read_text()))
    return cluster.wait_established(CRD_NAME)


@pytest.fixture
def new_namespace(cluster):
    """Make namespaces (name prefix → name) that are deleted after the test, passed or not."""
    made = []

    def make(prefix):
        made.append(cluster.new_namespace(prefix))
        return made[-1]

    yield make
    for name in made:
        cluster.delete("Namespace", name)


@pytest.fixture
def namespace(crd, new_namespace):
    return new_namespace("afd-test")


def sample_in(name: str, namespace: str) -> dict:
    """The sample custom resource `name` (a file of crds/samples), placed in `namespace`."""
    body = yaml.safe_load(next(p for p in SAMPLES if p.name == name).read_text())
    body["metadata"]["namespace"] = namespace
    return body


def kubectl(cluster: Cluster, *args: str) -> str:
    """kubectl's output against `cluster` (skips without kubectl on the PATH or KUBECTL); fails on an error."""
    kubectl = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl is not on the PATH (or KUBECTL)")
    return subprocess.run([kubectl, "--kubeconfig", str(cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=60, check=True).stdout
