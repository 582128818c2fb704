"""Per-group NetworkPolicies (spec.networkPolicy). Pure.

Ingress only, one policy per role of a group, selecting that role's pods:
- FFN pods admit the control and data ports only from pods of the same AFD deployment
  and group (`afd.io/name` + `afd.io/group`), so no pod of another group, revision-less
  stray or foreign workload can reach a connector port;
- attention pods admit the HTTP port from anywhere (the client Service fronts them);
- both admit the metrics port from pods of the resource's namespace, or from the
  namespaces `metricsNamespaceSelector` selects (e.g. where Prometheus runs);
- with the nccl connector, pods of the same group admit each other on every port: NCCL's
  bootstrap and transports listen on ports of their own choosing, in both directions.
Kubelet probes come from the node, which Kubernetes always admits.
"""

from __future__ import annotations

from typing import Any

from afd_operator.model import labels as L
from afd_operator.model.spec import AFDDeploymentSpec, Owner


def render_network_policy(
    spec: AFDDeploymentSpec, owner: Owner, index: int, role: str, revision: str
) -> dict[str, Any]:
    """The NetworkPolicy guarding the pods of `role` in group `index`."""
    ports = spec.ports
    same_group = [{"podSelector": {"matchLabels": {L.NAME: owner.name, L.GROUP: str(index)}}}]
    ingress: list[dict[str, Any]] = []
    if spec.afd.connector == "nccl":
        ingress.append({"from": same_group})  # every port, from the group's own pods only
    elif role == "ffn":
        ingress.append({"from": same_group, "ports": _ports(ports.control, ports.data)})
    if role == "attention":
        ingress.append({"ports": _ports(ports.http)})  # from anywhere: this is the API
    ingress.append({"from": [_metrics_peer(spec)], "ports": _ports(ports.metrics)})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": L.role_name(owner.name, index, role),
            "namespace": owner.namespace,
            "labels": L.role_labels(owner.name, index, role, revision),
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "podSelector": {"matchLabels": L.role_selector(owner.name, index, role)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _metrics_peer(spec: AFDDeploymentSpec) -> dict[str, Any]:
    selector = spec.network_policy.metrics_namespace_selector
    if selector is None:
        return {"podSelector": {}}  # any pod of this namespace
    return {"namespaceSelector": {"matchLabels": dict(selector.match_labels)}}  # {}: every namespace


def _ports(*numbers: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": n} for n in numbers]
