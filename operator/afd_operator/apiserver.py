"""The one module that talks to the Kubernetes API (besides kopf itself).

Children are written with server-side apply under the field manager `afd-operator`, so
fields that other managers own (an HPA's `replicas` on the resource, a mutating
webhook's additions on pods) are never fought over. API errors are translated here into
`KubeError`, whose message says what failed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Optional, Protocol

from afd_operator.model.labels import OPERATOR
from afd_operator.model.spec import API_VERSION

log = logging.getLogger(__name__)

# kind → plural, for every kind the operator writes. RBAC (rbac.yaml) grants exactly these.
PLURALS = {
    "AFDDeployment": "afddeployments",
    "ConfigMap": "configmaps",
    "Event": "events",
    "Service": "services",
    "Pod": "pods",
    "StatefulSet": "statefulsets",
    "Deployment": "deployments",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "PodMonitor": "podmonitors",
    "PodGroup": "podgroups",
    "Secret": "secrets",
    "NetworkPolicy": "networkpolicies",
}


class KubeError(RuntimeError):
    """A Kubernetes API call that failed; `status` is the HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Store(Protocol):
    """What the reconciler needs from the cluster; fakes implement it in tests."""

    def apply(self, obj: dict[str, Any]) -> None: ...

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Optional[dict[str, Any]]: ...

    def create(self, obj: dict[str, Any]) -> None: ...

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None: ...

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool: ...

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None: ...

    def post_event(self, owner: dict[str, Any], type: str, reason: str, message: str) -> None: ...


def object_path(api_version: str, kind: str, namespace: str, name: str = "") -> str:
    """REST path of a namespaced object (or its collection when `name` is empty)."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{PLURALS[kind]}"
    return f"{path}/{name}" if name else path


class KubeStore:
    """`Store` over the official `kubernetes` client (kubeconfig or in-cluster credentials)."""

    def __init__(self, api_client: Any) -> None:
        self._api = api_client

    @classmethod
    def from_environment(cls) -> "KubeStore":
        """Credentials from the pod's service account, else from `KUBECONFIG`/~/.kube/config."""
        import kubernetes  # the operator extra: `afd-operator render` imports this module (reconcile.secret) without it

        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            # Read KUBECONFIG now: the client reads its default only once, at import time.
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        return cls(kubernetes.client.ApiClient())

    def apply(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        self._call(
            "PATCH", path, obj,
            query=[("fieldManager", OPERATOR), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Optional[dict[str, Any]]:
        """One object, or None when it does not exist."""
        try:
            return self._call("GET", object_path(api_version, kind, namespace, name), None)
        except KubeError as err:
            if err.status == 404:
                return None
            raise

    def create(self, obj: dict[str, Any]) -> None:
        """Create `obj`; KubeError 409 when it exists (unlike apply, never touches an existing one)."""
        meta = obj["metadata"]
        self._call("POST", object_path(obj["apiVersion"], obj["kind"], meta["namespace"]), obj)

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """Merge-patch one object."""
        self._call("PATCH", object_path(api_version, kind, namespace, name), patch,
                   content_type="application/merge-patch+json")

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch the status subresource of an AFDDeployment."""
        path = object_path(API_VERSION, "AFDDeployment", namespace, name) + "/status"
        self._call("PATCH", path, {"status": status}, content_type="application/merge-patch+json")

    def post_event(self, owner: dict[str, Any], type: str, reason: str, message: str) -> None:
        """Record a core/v1 Event on an AFDDeployment (`owner` is its metadata)."""
        self._call("POST", object_path("v1", "Event", owner["namespace"]),
                   render_event(owner, type, reason, message, time.time()))

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete one object (its dependents in the background); False if it was not there."""
        path = object_path(api_version, kind, namespace, name)
        try:
            self._call("DELETE", path, {"propagationPolicy": "Background"})
        except KubeError as err:
            if err.status == 404:
                return False
            raise
        return True

    def _call(
        self, method: str, path: str, body: Any, query: list | None = None,
        content_type: str = "application/json",
    ) -> Any:
        from kubernetes.client.exceptions import ApiException  # the operator extra (see from_environment)

        api = self._api
        try:
            request = api.param_serialize(
                method=method, resource_path=path, query_params=query or [],
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body, auth_settings=["BearerToken"],
            )
            response = api.call_api(*request)
            response.read()
        except ApiException as err:
            raise KubeError(err.status or 0, f"{method} {path}: {_reason(err)}") from None
        except OSError as err:  # urllib3 wraps connection failures in OSError subclasses
            raise KubeError(0, f"{method} {path}: no answer from the API server ({err})") from None
        if response.status >= 400:  # the client returns error responses too: say what the server said
            raise KubeError(response.status, f"{method} {path}: {_status_text(response.status, response.data)}")
        return json.loads(response.data or b"null")


def render_event(owner: dict[str, Any], type: str, reason: str, message: str, now: float) -> dict[str, Any]:
    """A core/v1 Event about the AFDDeployment whose metadata is `owner`."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{owner['name']}.", "namespace": owner["namespace"]},
        "involvedObject": {"apiVersion": API_VERSION, "kind": "AFDDeployment", "name": owner["name"],
                           "namespace": owner["namespace"], "uid": owner.get("uid", "")},
        "type": type,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": OPERATOR},
        "reportingComponent": OPERATOR,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def _status_text(status: int, data: Any) -> str:
    """`HTTP 403 Forbidden: <the API server's message>` from a Status body, else `HTTP 403`."""
    try:
        body = json.loads(data)
        return f"HTTP {status} {body.get('reason', '')}: {body.get('message', '')}"
    except (TypeError, ValueError, AttributeError):
        return f"HTTP {status}"


def _reason(err: Any) -> str:
    try:
        body = json.loads(err.body)
        return f"HTTP {err.status} {body.get('reason', '')}: {body.get('message', '')}"
    except (TypeError, ValueError):
        return f"HTTP {err.status} {err.reason}"
