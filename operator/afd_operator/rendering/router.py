"""Render the router of an AFDDeployment (`spec.router`): the front door as a Deployment. Pure.

When enabled: a headless Service `<name>-ranks` over the attention pods of every group, Ready ones only (no
`publishNotReadyAddresses`), which the router resolves to find its ranks (no Role needed); a Deployment of
`router.replicas` pods running `afd route` from the runtime image, with probes on its metrics port, a preStop
drain, the group Secret (it signs the streams it moves) and the API key Secret; a PodDisruptionBudget; a
PodMonitor when `spec.monitoring.podMonitor`. The client Service (`rendering.children.render_client_service`)
then selects the router pods instead of the attention pods. Router pods carry `afd.io/router`, not
`afd.io/name` (their Deployment does carry it), so the groups' selectors (the deployment's PodDisruptionBudget
and PodMonitor, the operator's pod watch) never take them.
"""

from __future__ import annotations

import math
from typing import Any

from afd_operator.model import labels as L
from afd_operator.model.spec import AFDDeploymentSpec, Owner
from afd_operator.rendering.pod import DRAIN_SECONDS, READINESS, STOP_MARGIN_SECONDS, api_key_env
from afd_operator.rendering.security import (
    container_security_context, group_secret_env, pod_security_context, scratch_env, scratch_mounts,
    scratch_volumes,
)

LIVENESS = {"periodSeconds": 5, "failureThreshold": 3, "timeoutSeconds": 5}


def render_router(spec: AFDDeploymentSpec, owner: Owner) -> list[dict]:
    """The router's objects in the order they are applied (none when `spec.router.enabled` is false)."""
    if not spec.router.enabled:
        return []
    objects = [render_ranks_service(spec, owner), render_router_deployment(spec, owner),
               render_router_disruption_budget(spec, owner)]
    if spec.monitoring.pod_monitor:
        objects.append(render_router_pod_monitor(spec, owner))
    return objects


def router_kinds() -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name function) of every object `render_router` may make (to prune when disabled)."""
    return [("v1", "Service", L.ranks_name), ("apps/v1", "Deployment", L.router_name),
            ("policy/v1", "PodDisruptionBudget", L.router_name), ("monitoring.coreos.com/v1", "PodMonitor", L.router_name)]


def render_ranks_service(spec: AFDDeploymentSpec, owner: Owner) -> dict:
    """DNS of the Ready attention pods of every group: one A record per pod, gone once it is unready."""
    ports = spec.ports
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, L.ranks_name(owner.name), L.shared_labels(owner.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": {L.NAME: owner.name, L.ROLE: "attention"},
            "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"}
                      for n, p in (("http", ports.http), ("metrics", ports.metrics))],
        },
    }


def router_termination_grace_seconds(spec: AFDDeploymentSpec) -> int:
    """The drain (unready at once, serving on until no request has run for a second), then in-flight relays get the
    shutdown grace, then a margin."""
    return DRAIN_SECONDS + 2 * math.ceil(spec.shutdown_grace_seconds) + STOP_MARGIN_SECONDS


def render_router_env(spec: AFDDeploymentSpec, owner: Owner) -> list[dict]:
    router, ports = spec.router, spec.ports
    values = {
        "AFD_HTTP_PORT": router.port,
        "AFD_METRICS_PORT": router.metrics_port,
        "AFD_ROUTE_RANKS": f"{L.ranks_name(owner.name)}.{owner.namespace}.svc",
        "AFD_ROUTE_RANK_HTTP_PORT": ports.http,
        "AFD_ROUTE_RANK_METRICS_PORT": ports.metrics,
        "AFD_SHUTDOWN_GRACE_S": f"{spec.shutdown_grace_seconds:g}",
    }
    env = [{"name": k, "value": str(v)} for k, v in values.items()]
    env += [group_secret_env(owner), *api_key_env(spec), *scratch_env()]
    return env + [{"name": e.name, "value": e.value} for e in router.env]


def render_router_deployment(spec: AFDDeploymentSpec, owner: Owner) -> dict:
    router = spec.router
    health = {"path": "/health", "port": "metrics"}
    drain = DRAIN_SECONDS + math.ceil(spec.shutdown_grace_seconds)
    container: dict[str, Any] = {
        "name": "router",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["afd", "route"],
        "env": render_router_env(spec, owner),
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": router.metrics_port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": health, **READINESS},
        "livenessProbe": {"httpGet": {"path": "/live", "port": "metrics"}, **LIVENESS},
        "lifecycle": {"preStop": {"httpGet": {"path": f"/drain?seconds={drain}", "port": "metrics"}}},
        "securityContext": container_security_context(),
        "volumeMounts": scratch_mounts(),
    }
    resources = {k: {r: str(q) for r, q in v.items()} for k, v in router.resources.model_dump(exclude_defaults=True).items()}
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # DNS finds the ranks: the router never talks to the API server
        "terminationGracePeriodSeconds": router_termination_grace_seconds(spec),
        "securityContext": pod_security_context(spec),
        "containers": [container],
        "volumes": scratch_volumes(),
    }
    optional = {
        "priorityClassName": spec.priority_class_name,
        "imagePullSecrets": [{"name": s.name} for s in spec.image_pull_secrets],
        "nodeSelector": dict(router.node_selector),
        "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in router.tolerations],
    }
    pod.update({k: v for k, v in optional.items() if v})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, L.router_name(owner.name), L.router_labels(owner.name)),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": L.router_selector(owner.name)},
            # a new pod Ready before an old one drains: a rollout never lowers the serving replicas
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": L.router_pod_labels(owner.name)}, "spec": pod},
        },
    }


def render_router_disruption_budget(spec: AFDDeploymentSpec, owner: Owner) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, L.router_name(owner.name), L.router_labels(owner.name)),
        "spec": {"maxUnavailable": spec.router.max_unavailable,
                 "selector": {"matchLabels": L.router_selector(owner.name)}},
    }


def render_router_pod_monitor(spec: AFDDeploymentSpec, owner: Owner) -> dict:
    """The router's `afd_front_*` series, labelled `afd_io_name` like the ranks' (the dashboards select by it)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _meta(owner, L.router_name(owner.name), L.router_labels(owner.name)),
        "spec": {
            "selector": {"matchLabels": L.router_selector(owner.name)},
            "podMetricsEndpoints": [{
                "port": "metrics", "path": "/metrics", "interval": spec.monitoring.interval,
                "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_label_afd_io_router"],
                                 "targetLabel": "afd_io_name"}],
            }],
        },
    }


def _meta(owner: Owner, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": dict(labels), "ownerReferences": [owner.reference()]}
