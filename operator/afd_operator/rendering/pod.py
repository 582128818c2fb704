"""Render the pod template of one role of one group. Pure.

The pod contract (docs/configuration.md): the whole runtime configuration arrives as `AFD_*`
environment variables plus the group's ConfigMap mounted at /etc/afd; the rank is the
StatefulSet ordinal in `$HOSTNAME`, which the runtime reads itself.
"""

from __future__ import annotations

import math
from typing import Any

from afd.config import SETTINGS
from afd_operator.model import labels as L
from afd_operator.model.spec import AFDDeploymentSpec, Owner
from afd_operator.rendering.security import (
    container_security_context, group_secret_env, pod_security_context, scratch_env, scratch_mounts,
    scratch_volumes,
)

CONFIG_DIR = "/etc/afd"
CONFIG_FILE = f"{CONFIG_DIR}/afd.yaml"
MODEL_DIR = "/models"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
DEFAULT_SCHEDULERS = {"volcano": "volcano", "scheduler-plugins": "scheduler-plugins-scheduler"}
# Disruptions (docs/failure-handling.md). A pod being stopped first stays in service this
# long, unready, so that every proxy has dropped it from the client Service before it stops accepting.
DRAIN_SECONDS = 5
STOP_MARGIN_SECONDS = 10  # after the grace: the engine stops, the FFN link says goodbye
# Readiness follows the FFN link (the runtime answers 503 as soon as it is lost): probed every
# second, one failure is enough. The probe server is its own thread, so 2 s never times out a live pod.
READINESS = {"periodSeconds": 1, "failureThreshold": 1, "successThreshold": 1, "timeoutSeconds": 2}
# Liveness (/live): 503 only when the engine (attention) or the worker loop (FFN) is dead or stuck;
# tolerant, so a blip never restarts a rank that holds minutes of warm-up.
LIVENESS = {"failureThreshold": 3, "timeoutSeconds": 5}
# The hf:// download init container when model.downloadResources is empty: a ResourceQuota that
# requires requests and limits refuses a pod any of whose containers lacks them.
DOWNLOAD_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"cpu": "2", "memory": "2Gi"}}
# spec.afd settings every pod gets as AFD_* variables, and those only vLLM attention pods get; every other
# spec.afd setting reaches the runtime through the group's ConfigMap (render.render_config_map).
ENV_SETTINGS = ("connector", "stages", "gate_on_attention", "cuda_graphs")
VLLM_ENV_SETTINGS = ("attention_engine", "vllm_args")


def _as_env(runtime: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {SETTINGS[name].env: runtime[name] for name in names}


def ffn_address_template(owner: Owner, index: int) -> str:
    """Stable DNS of FFN rank `{rank}` through the headless Service (resolves before Ready)."""
    ffn = L.role_name(owner.name, index, "ffn")
    return f"{ffn}-{{rank}}.{ffn}.{owner.namespace}.svc"


def model_path(spec: AFDDeploymentSpec) -> str:
    """Where the checkpoint is inside the pod (AFD_MODEL)."""
    parts = spec.model.parts
    if spec.model.kind == "pvc":
        return MODEL_DIR + (parts["sub"] or "").rstrip("/")
    if spec.model.kind == "hf":
        return f"{MODEL_DIR}/{parts['repo']}"
    return MODEL_DIR


def _engine_env(spec: AFDDeploymentSpec, owner: Owner, role: str) -> dict:
    """Attention pods: with our engine, where requests they cannot serve go on (the client
    Service, so another group answers them); with vLLM, the engine switch and its arguments."""
    afd = spec.afd
    if role != "attention":
        return {}
    if afd.attention_engine == "afd":
        return {"AFD_FAILOVER_URL": f"http://{owner.name}.{owner.namespace}.svc:{spec.ports.http}"}
    return _as_env(afd.runtime(), VLLM_ENV_SETTINGS)


def api_key_env(spec: AFDDeploymentSpec) -> list[dict]:
    """Attention and router pods: AFD_API_KEY from the Secret `spec.api.apiKeySecretRef` names (kubelet reads it;
    the key is in no ConfigMap, env literal or object the operator writes)."""
    ref = spec.api.api_key_secret_ref
    if ref is None:
        return []
    return [{"name": SETTINGS["api_key"].env, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def _parser_env(spec: AFDDeploymentSpec, role: str) -> list[dict]:
    """Attention pods: the parsers `spec.api` names (tool calls, reasoning), where it names them."""
    named = {"tool_call_parser": spec.api.tool_call_parser, "reasoning_parser": spec.api.reasoning_parser}
    if role != "attention":
        return []
    return [{"name": SETTINGS[name].env, "value": value} for name, value in named.items() if value is not None]


def render_env(spec: AFDDeploymentSpec, owner: Owner, index: int, role: str, revision: str) -> list[dict]:
    """The AFD_* environment of one role pod (the rank comes from $HOSTNAME)."""
    afd, ports = spec.afd, spec.ports
    values = {
        "AFD_ROLE": role,
        "AFD_NUM_ATTENTION_RANKS": spec.attention.ranks,
        "AFD_NUM_FFN_RANKS": spec.ffn.ranks,
        "AFD_FFN_ADDRESS_TEMPLATE": ffn_address_template(owner, index),
        "AFD_CONTROL_PORT": ports.control,
        "AFD_DATA_PORT": ports.data,
        **_as_env(afd.runtime(), ENV_SETTINGS),
        "AFD_MODEL": model_path(spec),
        # Not the basename of the mount (always "models"): the name clients ask for.
        "AFD_SERVED_MODEL_NAME": spec.served_model_name or spec.model.default_served_name,
        "AFD_HTTP_PORT": ports.http,
        "AFD_METRICS_PORT": ports.metrics,
        **_engine_env(spec, owner, role),
        # only when set, so the pods of groups without expert parallelism stay as they were
        **({"AFD_FFN_EXPERT_PARALLEL": spec.ffn.expert_parallel} if spec.ffn.expert_parallel > 1 else {}),
        # Both roles of a group share it; a pod of another group or revision is refused.
        "AFD_GROUP_TOKEN": f"{L.group_name(owner.name, index)}-{revision}",
        "AFD_CONFIG_FILE": CONFIG_FILE,
    }
    env = [{"name": k, "value": _text(v)} for k, v in values.items()] + [group_secret_env(owner)]
    env += api_key_env(spec) if role == "attention" else []
    env += _parser_env(spec, role)
    env += scratch_env()
    return env + [{"name": e.name, "value": e.value} for e in _role(spec, role).env]


def render_pod_template(
    spec: AFDDeploymentSpec, owner: Owner, index: int, role: str, revision: str
) -> dict[str, Any]:
    """The StatefulSet pod template of `role` in group `index` at `revision`."""
    role_spec = _role(spec, role)
    metadata: dict[str, Any] = {"labels": L.role_labels(owner.name, index, role, revision)}
    pod: dict[str, Any] = {
        "enableServiceLinks": False,  # dozens of *_SERVICE_HOST variables help no one here
        # No container of a role pod talks to the Kubernetes API: no token in the pod to steal.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec, role),
        "securityContext": pod_security_context(spec),
        "containers": [_container(spec, owner, index, role, revision)],
        "volumes": _volumes(spec, owner, index),
    }
    if spec.model.kind == "hf":
        pod["initContainers"] = [_download_container(spec)]
    optional = {
        "serviceAccountName": spec.service_account_name,
        "priorityClassName": spec.priority_class_name,
        "imagePullSecrets": [{"name": s.name} for s in spec.image_pull_secrets],
        "nodeSelector": dict(role_spec.node_selector),
        "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in role_spec.tolerations],
        "affinity": _affinity(spec, owner, index),
    }
    pod.update({k: v for k, v in optional.items() if v})
    gang = spec.gang_scheduling
    if gang.enabled:
        pod["schedulerName"] = gang.scheduler_name or DEFAULT_SCHEDULERS[gang.scheduler]
        group = L.podgroup_name(owner.name, index)
        if gang.scheduler == "volcano":
            metadata["annotations"] = {VOLCANO_GROUP_ANNOTATION: group}
        else:
            metadata["labels"][COSCHEDULING_GROUP_LABEL] = group
    return {"metadata": metadata, "spec": pod}


def termination_grace_seconds(spec: AFDDeploymentSpec, role: str) -> int:
    """Attention: the drain (which serves on until no request runs, at most the shutdown grace after
    DRAIN_SECONDS), then whatever is still in flight finishes within the shutdown grace, then the
    engine stops. The FFN serves its attention ranks through all of that (its drain tells them to
    finish and waits until they have left or gone quiet), so it gets that long plus a margin."""
    attention = DRAIN_SECONDS + 2 * math.ceil(spec.shutdown_grace_seconds) + STOP_MARGIN_SECONDS
    return attention if role == "attention" else attention + STOP_MARGIN_SECONDS


def _probes(spec: AFDDeploymentSpec, role: str) -> dict:
    """Probes and the preStop drain of a role container."""
    period = spec.probes.period_seconds
    startup = {"periodSeconds": period, "failureThreshold": math.ceil(spec.probes.startup_timeout_seconds / period)}
    if role == "attention" and spec.afd.attention_engine != "afd":
        # vLLM's own server: /health on the API port, no drain endpoint; the kubelet sleeps instead.
        health = {"path": "/health", "port": "http"}
        return {
            "readinessProbe": {"httpGet": health, "periodSeconds": period, "failureThreshold": 3},
            "startupProbe": {"httpGet": health, **startup},
            "lifecycle": {"preStop": {"sleep": {"seconds": DRAIN_SECONDS}}},
        }
    # Our probe server (afd.server.probe_http) on the metrics port: /health is readiness (after
    # warm-up; 503 as soon as the FFN link is lost), /live fails only when the engine is dead.
    health = {"path": "/health", "port": "metrics"}
    live = {"httpGet": {"path": "/live", "port": "metrics"}, "periodSeconds": period, **LIVENESS}
    if role == "attention":
        # unready at once, serving on while the endpoint removal spreads, then until no request runs (the
        # runtime ends it early; issue 38): a stop never closes a connection a client is sending on
        drain = DRAIN_SECONDS + math.ceil(spec.shutdown_grace_seconds)
        probes = {"readinessProbe": {"httpGet": health, **READINESS}, "livenessProbe": live}
    else:
        drain = termination_grace_seconds(spec, "attention")  # returns early once its attention ranks left
        probes = {"readinessProbe": {"httpGet": health, "periodSeconds": period, "failureThreshold": 3},
                  "livenessProbe": live}
    # Loading weights and capturing graphs takes minutes: hold the other probes off until then.
    probes["startupProbe"] = {"httpGet": health, **startup}
    probes["lifecycle"] = {"preStop": {"httpGet": {"path": f"/drain?seconds={drain}", "port": "metrics"}}}
    return probes


def _container(spec: AFDDeploymentSpec, owner: Owner, index: int, role: str, revision: str) -> dict:
    ports = spec.ports
    if role == "attention":
        container_ports = [("http", ports.http), ("metrics", ports.metrics)]
    else:
        container_ports = [("control", ports.control), ("data", ports.data), ("metrics", ports.metrics)]
    resources = _resources(_role(spec, role).resources)
    container = {
        "name": role,
        "image": (spec.afd.attention_image or spec.image) if role == "attention" else spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["afd", "serve"],
        "env": render_env(spec, owner, index, role, revision),
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in container_ports],
        **_probes(spec, role),
        "securityContext": container_security_context(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "model", "mountPath": MODEL_DIR, "readOnly": spec.model.kind != "hf"},
            *scratch_mounts(),
        ],
    }
    if resources:
        container["resources"] = resources
    return container


def _resources(resources) -> dict:
    """A container's `resources` from a spec's Resources ({} when it sets none); quantities as strings."""
    given = resources.model_dump(exclude_defaults=True)
    return {k: {r: _quantity(q) for r, q in v.items()} for k, v in given.items()}


def _download_container(spec: AFDDeploymentSpec) -> dict:
    parts = spec.model.parts
    command = ["hf", "download", parts["repo"], "--local-dir", model_path(spec)]
    if parts["rev"]:
        command += ["--revision", parts["rev"]]
    container: dict[str, Any] = {
        "name": "model-download",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": command,
        "env": scratch_env(),
        "resources": _resources(spec.model.download_resources) or DOWNLOAD_RESOURCES,
        "securityContext": container_security_context(),
        "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR}, *scratch_mounts()],
    }
    if spec.model.secret_ref:
        ref = spec.model.secret_ref
        container["env"].append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return container


def _volumes(spec: AFDDeploymentSpec, owner: Owner, index: int) -> list[dict]:
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.shm_size_limit:
        shm["sizeLimit"] = spec.shm_size_limit
    model = spec.model
    parts = model.parts
    if model.kind == "pvc":
        source: dict[str, Any] = {"persistentVolumeClaim": {"claimName": parts["claim"], "readOnly": True}}
    elif model.kind == "host":
        source = {"hostPath": {"path": parts["path"], "type": "Directory"}}
    elif model.cache.claim_name:
        source = {"persistentVolumeClaim": {"claimName": model.cache.claim_name}}
    else:
        cache = {"sizeLimit": model.cache.size_limit} if model.cache.size_limit else {}
        source = {"emptyDir": cache}
    return [
        {"name": "config", "configMap": {"name": L.config_name(owner.name, index)}},
        # Memory-backed so NCCL and torch have room; it lives as long as the pod.
        {"name": "shm", "emptyDir": shm},
        {"name": "model", **source},
        *scratch_volumes(),
    ]


def _affinity(spec: AFDDeploymentSpec, owner: Owner, index: int) -> dict:
    if spec.placement is None:
        return {}
    term = {
        "labelSelector": {"matchLabels": {L.NAME: owner.name, L.GROUP: str(index)}},
        "topologyKey": spec.placement.topology_key,
    }
    if spec.placement.mode == "Required":
        return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    weighted = {"weight": 100, "podAffinityTerm": term}
    return {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [weighted]}}


def _role(spec: AFDDeploymentSpec, role: str):
    return spec.attention if role == "attention" else spec.ffn


def _quantity(value: Any) -> Any:
    return value if isinstance(value, str) else str(value)


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
