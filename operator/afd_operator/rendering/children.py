"""Render the children of an AFDDeployment. Pure: spec in, manifests out.

Per group: a ConfigMap, two headless Services (created first, so rank DNS exists before
any pod starts), an optional PodGroup, and two StatefulSets. Per resource: the client
Service over Ready attention pods (or the router's pods, `rendering.router`), and an optional PodDisruptionBudget
and PodMonitor.
Every child carries the `afd.io/*` labels and a controller ownerReference.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import yaml

from afd_operator.model import labels as L
from afd_operator.model.spec import AFDDeploymentSpec, AFDSettings, Owner
from afd_operator.rendering.network import render_network_policy
from afd_operator.rendering.pod import ENV_SETTINGS, VLLM_ENV_SETTINGS, render_pod_template
from afd_operator.rendering.router import render_router

VOLCANO_PODGROUP = "scheduling.volcano.sh/v1beta1"
COSCHEDULING_PODGROUP = "scheduling.x-k8s.io/v1alpha1"


def render_group(spec: AFDDeploymentSpec, owner: Owner, index: int, revision: str) -> list[dict]:
    """Every object of group `index` at `revision`, in the order they must be applied."""
    objects = [render_config_map(spec, owner, index, revision)]
    objects += [render_headless_service(spec, owner, index, role, revision) for role in L.ROLES]
    if spec.gang_scheduling.enabled:
        objects.append(render_pod_group(spec, owner, index, revision))
    if spec.network_policy.enabled:
        objects += [render_network_policy(spec, owner, index, role, revision) for role in L.ROLES]
    # FFN first: attention ranks dial FFN ranks, so the listeners should come up first.
    objects += [render_stateful_set(spec, owner, index, role, revision) for role in ("ffn", "attention")]
    return objects


def render_shared(spec: AFDDeploymentSpec, owner: Owner, to_router: bool = False) -> list[dict]:
    """The objects shared by all groups of the resource (`to_router`: the client Service selects the router's pods;
    the router's own objects are `rendering.router`'s)."""
    objects = [render_client_service(spec, owner, to_router)]
    if spec.pod_disruption_budget.enabled:
        objects.append(render_disruption_budget(spec, owner))
    if spec.monitoring.pod_monitor:
        objects.append(render_pod_monitor(spec, owner))
    return objects


def render_all(
    spec: AFDDeploymentSpec, owner: Owner, groups: Optional[dict[int, str]] = None
) -> list[dict]:
    """Everything for `groups` (index → revision); by default groups 0..replicas-1 at the spec's revision; with
    `spec.router` its objects and the client Service on the router (as once a router pod is Ready)."""
    if groups is None:
        groups = {i: spec.revision for i in range(spec.replicas)}
    objects: list[dict] = []
    for index in sorted(groups):
        objects += render_group(spec, owner, index, groups[index])
    return objects + render_router(spec, owner) + render_shared(spec, owner, to_router=spec.router.enabled)


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings, so embedded config files stay readable; no
    anchors, so every manifest reads on its own."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _represent_str)


def dump_yaml(objects: Iterable[dict]) -> str:
    """Manifests as one multi-document YAML stream, stable for golden files."""
    return yaml.dump_all(list(objects), Dumper=_Dumper, sort_keys=True, default_flow_style=False)


# spec.afd's runtime settings (AFDSettings.runtime) not rendered as AFD_* variables (rendering.pod) reach the pods
# in the group's ConfigMap: always (CONFIG_ALWAYS), or only when set off their default (so existing groups'
# config and revision stay); api_servers becomes api_process + api_servers when set.
CONFIG_ALWAYS = ("dtype", "max_num_seqs", "max_model_len")
CONFIG_WHEN_SET = tuple(name for name in AFDSettings().runtime()
                        if name not in CONFIG_ALWAYS + ENV_SETTINGS + VLLM_ENV_SETTINGS)


def render_config_map(spec: AFDDeploymentSpec, owner: Owner, index: int, revision: str) -> dict:
    """Runtime settings beyond the env contract, in `afd.config` field names, plus the rank map."""
    afd, defaults = spec.afd, AFDSettings().runtime()
    values = afd.runtime()
    runtime = {name: values[name] for name in CONFIG_ALWAYS}
    runtime.update({name: values[name] for name in CONFIG_WHEN_SET if values[name] != defaults[name]})
    if afd.api_servers:  # the API in that many processes beside the engine core (afd.server.api_process)
        runtime.update(api_process=True, api_servers=afd.api_servers)
    topology = spec.topology
    rank_map = {
        "topology": str(topology),
        "ffn_to_attention": {f: list(topology.attention_ranks_of(f)) for f in range(topology.num_ffn)},
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, L.config_name(owner.name, index), L.group_labels(owner.name, index, revision)),
        "data": {
            "afd.yaml": yaml.safe_dump(runtime, sort_keys=True),
            "topology.yaml": yaml.safe_dump(rank_map, sort_keys=True),
        },
    }


def render_headless_service(
    spec: AFDDeploymentSpec, owner: Owner, index: int, role: str, revision: str
) -> dict:
    """Stable per-rank DNS; `publishNotReadyAddresses` because ranks rendezvous before Ready."""
    ports = spec.ports
    named = (
        [("http", ports.http), ("metrics", ports.metrics)]
        if role == "attention"
        else [("control", ports.control), ("data", ports.data), ("metrics", ports.metrics)]
    )
    name = L.role_name(owner.name, index, role)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, name, L.role_labels(owner.name, index, role, revision)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": L.role_selector(owner.name, index, role),
            "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in named],
        },
    }


def render_stateful_set(
    spec: AFDDeploymentSpec, owner: Owner, index: int, role: str, revision: str
) -> dict:
    """One pod per rank (per shard of an FFN rank: ordinal rank·G + shard). `OnDelete`: the operator
    replaces a whole group at once, so the StatefulSet controller must never roll a single rank to a
    new revision."""
    name = L.role_name(owner.name, index, role)
    ranks = spec.pods(role)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(owner, name, L.role_labels(owner.name, index, role, revision)),
        "spec": {
            "replicas": ranks,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": L.role_selector(owner.name, index, role)},
            "template": render_pod_template(spec, owner, index, role, revision),
        },
    }


def render_pod_group(spec: AFDDeploymentSpec, owner: Owner, index: int, revision: str) -> dict:
    """Gang scheduling: no rank of a group is bound until all of them can be."""
    gang = spec.gang_scheduling
    members = spec.pods("attention") + spec.pods("ffn")
    meta = _meta(owner, L.podgroup_name(owner.name, index), L.group_labels(owner.name, index, revision))
    if gang.scheduler == "volcano":
        return {"apiVersion": VOLCANO_PODGROUP, "kind": "PodGroup", "metadata": meta,
                "spec": {"minMember": members}}
    return {"apiVersion": COSCHEDULING_PODGROUP, "kind": "PodGroup", "metadata": meta,
            "spec": {"minMember": members, "scheduleTimeoutSeconds": gang.timeout_seconds}}


def render_client_service(spec: AFDDeploymentSpec, owner: Owner, to_router: bool = False) -> dict:
    """The API endpoint: Ready attention pods of every group (Ready = warmed up, serving), or with `to_router` the
    router's Ready pods (`spec.router`, once one is Ready), which spread requests over those ranks."""
    selector = L.router_selector(owner.name) if to_router else {L.NAME: owner.name, L.ROLE: "attention"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, owner.name, _shared_labels(owner)),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": spec.ports.http, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_disruption_budget(spec: AFDDeploymentSpec, owner: Owner) -> dict:
    """Evicting any rank takes its whole group down, so bound voluntary evictions."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, owner.name, _shared_labels(owner)),
        "spec": {
            "maxUnavailable": spec.pod_disruption_budget.max_unavailable,
            "selector": {"matchLabels": {L.NAME: owner.name}},
        },
    }


def render_pod_monitor(spec: AFDDeploymentSpec, owner: Owner) -> dict:
    """Prometheus Operator scrape config for both roles' `metrics` port."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _meta(owner, owner.name, _shared_labels(owner)),
        "spec": {
            "selector": {"matchLabels": {L.NAME: owner.name}},
            # become the afd_io_name / afd_io_group labels the dashboards and alerts select by
            "podTargetLabels": [L.NAME, L.GROUP],
            "podMetricsEndpoints": [
                {"port": "metrics", "path": "/metrics", "interval": spec.monitoring.interval}
            ],
        },
    }


def optional_shared_kinds(spec: AFDDeploymentSpec) -> list[tuple[str, str]]:
    """(apiVersion, kind) of the shared optional objects the spec does NOT ask for (to prune)."""
    unwanted = []
    if not spec.pod_disruption_budget.enabled:
        unwanted.append(("policy/v1", "PodDisruptionBudget"))
    if not spec.monitoring.pod_monitor:
        unwanted.append(("monitoring.coreos.com/v1", "PodMonitor"))
    return unwanted


def unwanted_group_objects(spec: AFDDeploymentSpec, owner: Owner, index: int) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of the optional per-group objects the spec does NOT ask for (to prune)."""
    unwanted = []
    if not spec.network_policy.enabled:
        unwanted += [("networking.k8s.io/v1", "NetworkPolicy", L.role_name(owner.name, index, role))
                     for role in L.ROLES]
    return unwanted


def _shared_labels(owner: Owner) -> dict[str, str]:
    return L.shared_labels(owner.name)


def _meta(owner: Owner, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": dict(labels),
        "ownerReferences": [owner.reference()],
    }
