"""A real Kubernetes API server for tests: found through AFD_KUBECONFIG, talked to over REST.

Start one with the kit (control plane only is enough: etcd + kube-apiserver +
kube-controller-manager; Pods stay Pending as there is no kubelet):

    ../shared/tools/kube-local/up.sh
    export AFD_KUBECONFIG=$HOME/.cache/afd-kube-local/kubeconfig

Without AFD_KUBECONFIG the tests that need it skip (CI has no cluster). A separate variable,
not KUBECONFIG, so a developer's own cluster is never written to by accident.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import yaml

ENV = "AFD_KUBECONFIG"
ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "afd-operator"
# Helm's InstallOrder, for the kinds this chart renders (helm/pkg/release/util/kind_sorter.go).
INSTALL_ORDER = ["Namespace", "NetworkPolicy", "ServiceAccount", "Secret", "ConfigMap", "ClusterRole", "ClusterRoleBinding",
                 "Role", "RoleBinding", "Service", "Deployment", "Job"]
HOOK = "helm.sh/hook"
FIELD_MANAGER = "afd-tests"

# kind → (API path prefix, plural, namespaced) for every kind the tests touch.
KINDS: dict[str, tuple[str, str, bool]] = {
    "CustomResourceDefinition": ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    "Namespace": ("/api/v1", "namespaces", False),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "Secret": ("/api/v1", "secrets", True),
    "Service": ("/api/v1", "services", True),
    "Pod": ("/api/v1", "pods", True),
    "Event": ("/api/v1", "events", True),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "ReplicaSet": ("/apis/apps/v1", "replicasets", True),
    "StatefulSet": ("/apis/apps/v1", "statefulsets", True),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets", True),
    "Job": ("/apis/batch/v1", "jobs", True),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    "ResourceQuota": ("/api/v1", "resourcequotas", True),
    "AFDDeployment": ("/apis/afd.io/v1alpha1", "afddeployments", True),
}


class ApiError(Exception):
    """An HTTP error from the API server; `message` is the Status message it sent."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


def _api_error(status: int, body: Any, reason: Any) -> ApiError:
    try:
        details = json.loads(body)
    except (TypeError, ValueError):
        details = {}
    return ApiError(status, details.get("reason", str(reason)), details.get("message", str(body)))


def kubeconfig_or_skip() -> Path:
    """The kit's kubeconfig from AFD_KUBECONFIG, or pytest.skip with the reason."""
    import pytest

    value = os.environ.get(ENV)
    if not value:
        pytest.skip(f"no real API server: set {ENV} to a kubeconfig (start one with "
                    "../shared/tools/kube-local/up.sh; kubeconfig $HOME/.cache/afd-kube-local/kubeconfig)")
    path = Path(value)
    if not path.is_file():
        pytest.skip(f"{ENV}={value} is not a file (is the kit's control plane up?)")
    return path


def path_of(kind: str, namespace: Optional[str] = None, name: str = "", sub: str = "") -> str:
    prefix, plural, namespaced = KINDS[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespaced else f"{prefix}/{plural}"
    if name:
        path += f"/{name}"
    return path + (f"/{sub}" if sub else "")


def path_of_object(obj: dict[str, Any], sub: str = "") -> str:
    meta = obj["metadata"]
    return path_of(obj["kind"], meta.get("namespace"), meta["name"], sub)


class Cluster:
    """REST access to one API server, as whoever the kubeconfig names."""

    def __init__(self, kubeconfig: Path) -> None:
        import kubernetes

        self.kubeconfig = kubeconfig
        self.api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))

    def call(self, method: str, path: str, body: Any = None, query: Iterable[tuple[str, str]] = (),
             content_type: str = "application/json") -> Any:
        from kubernetes.client.exceptions import ApiException

        request = self.api.param_serialize(
            method=method, resource_path=path, query_params=list(query),
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body, auth_settings=["BearerToken"],
        )
        try:
            response = self.api.call_api(*request)
            response.read()
        except ApiException as err:
            raise _api_error(err.status, err.body, err.reason) from None
        if response.status >= 400:  # call_api returns error responses as well
            raise _api_error(response.status, response.data, response.reason)
        return json.loads(response.data or b"null")

    # --- verbs ---------------------------------------------------------------------------

    def apply(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply (as `kubectl apply --server-side --force-conflicts`), strict fields."""
        query = [("fieldManager", FIELD_MANAGER), ("force", "true"), ("fieldValidation", "Strict")]
        if dry_run:
            query.append(("dryRun", "All"))
        return self.call("PATCH", path_of_object(obj), obj, query, "application/apply-patch+yaml")

    def create(self, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        meta = obj["metadata"]
        query = [("fieldValidation", "Strict")] + ([("dryRun", "All")] if dry_run else [])
        return self.call("POST", path_of(obj["kind"], meta.get("namespace")), obj, query)

    def get(self, kind: str, name: str, namespace: Optional[str] = None) -> Optional[dict[str, Any]]:
        try:
            return self.call("GET", path_of(kind, namespace, name))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: Optional[str] = None, selector: str = "") -> list[dict[str, Any]]:
        query = [("labelSelector", selector)] if selector else []
        return self.call("GET", path_of(kind, namespace), None, query)["items"]

    def merge_patch(self, kind: str, name: str, namespace: Optional[str], patch: dict[str, Any],
                    sub: str = "") -> dict[str, Any]:
        return self.call("PATCH", path_of(kind, namespace, name, sub), patch, (),
                         "application/merge-patch+json")

    def delete(self, kind: str, name: str, namespace: Optional[str] = None,
               propagation: str = "Background") -> bool:
        try:
            self.call("DELETE", path_of(kind, namespace, name), {"propagationPolicy": propagation})
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return True

    # --- helpers -------------------------------------------------------------------------

    def new_namespace(self, prefix: str) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        return name

    def wait_established(self, name: str, timeout: float = 30) -> dict[str, Any]:
        def established():
            crd = self.get("CustomResourceDefinition", name)
            conditions = {c["type"]: c["status"] for c in ((crd or {}).get("status") or {}).get("conditions") or []}
            return crd if conditions.get("Established") == "True" else None

        return eventually(established, timeout, f"CRD {name} Established")

    def token_kubeconfig(self, service_account: str, namespace: str, path: Path, seconds: int = 3600) -> Path:
        """A kubeconfig that authenticates as `service_account` with a token from the
        TokenRequest API (as the kubelet mounts one into the operator's pod)."""
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                   "spec": {"expirationSeconds": seconds}}
        token = self.call("POST", path_of("ServiceAccount", namespace, service_account, "token"), request)
        admin = yaml.safe_load(self.kubeconfig.read_text())
        context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
        cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])["cluster"]
        cluster = dict(cluster)
        if "certificate-authority" in cluster:  # inline it: the file may be relative to the admin kubeconfig
            ca = Path(cluster.pop("certificate-authority"))
            ca = ca if ca.is_absolute() else self.kubeconfig.parent / ca
            cluster["certificate-authority-data"] = base64.b64encode(ca.read_bytes()).decode()
        user = f"system:serviceaccount:{namespace}:{service_account}"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "sa",
            "clusters": [{"name": "kit", "cluster": cluster}],
            "users": [{"name": user, "user": {"token": token["status"]["token"]}}],
            "contexts": [{"name": "sa", "context": {"cluster": "kit", "user": user}}],
        }))
        path.chmod(0o600)
        return path

    def whoami(self) -> str:
        review = self.call("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                           {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
        return review["status"]["userInfo"]["username"]


class HelmRelease:
    """`helm install` / `helm uninstall` of the chart, emulated honestly.

    helm-python-sdk renders the templates (it has no install). Like Helm on a first install,
    the chart's crds/ are created first (only if absent) and waited for; then the rendered
    objects are applied in Helm's install order with Helm's ownership annotations. Uninstall
    deletes them in reverse order and, like Helm, keeps the CRD. Not done: the chart's
    pre-install hook Job (it re-applies the CRDs on upgrades) needs a kubelet to complete, so
    the install renders with crds.upgradeJob.enabled=false (tests check the hook objects with
    a dry run); no Helm release Secret is written.
    """

    def __init__(self, cluster: Cluster, name: str, namespace: str, values: dict | None = None) -> None:
        import helm_python

        self.cluster, self.name, self.namespace = cluster, name, namespace
        values = {**copy.deepcopy(values or {}), "crds": {"upgradeJob": {"enabled": False}}}
        chart = helm_python.Chart.load(str(CHART))
        try:
            rendered = chart.render(values, name=name, namespace=namespace)
        finally:
            chart.close()
        docs = [d for n, text in sorted(rendered.items()) if not n.endswith("NOTES.txt")
                for d in yaml.safe_load_all(text) if d]
        assert not [d for d in docs if HOOK in (d["metadata"].get("annotations") or {})]
        self.objects = sorted(docs, key=lambda d: INSTALL_ORDER.index(d["kind"]))

    def install(self) -> None:
        for path in sorted((CHART / "crds").glob("*.yaml")):  # Helm: crds/ first, then wait for them
            crd = yaml.safe_load(path.read_text())
            if self.cluster.get("CustomResourceDefinition", crd["metadata"]["name"]) is None:
                self.cluster.apply(crd)
            self.cluster.wait_established(crd["metadata"]["name"])
        if self.cluster.get("Namespace", self.namespace) is None:  # --create-namespace
            self.cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}})
        for obj in self.objects:
            obj = copy.deepcopy(obj)
            obj["metadata"].setdefault("annotations", {}).update({
                "meta.helm.sh/release-name": self.name, "meta.helm.sh/release-namespace": self.namespace})
            self.cluster.apply(obj)

    def uninstall(self) -> None:
        for obj in reversed(self.objects):
            meta = obj["metadata"]
            self.cluster.delete(obj["kind"], meta["name"], meta.get("namespace"))

    def present(self) -> list[str]:
        return [f"{o['kind']}/{o['metadata']['name']}" for o in self.objects
                if self.cluster.get(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace"))]


def eventually(probe: Callable[[], Any], timeout: float, what: str, interval: float = 0.3) -> Any:
    """Poll `probe` until it returns something truthy; that value, or AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
