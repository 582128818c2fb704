"""Typed AFDDeployment spec, parsed once from the custom resource body.

The CRD schema (crds/afd.io_afddeployments.yaml) is the first line of defence: it
defaults and validates what the API server sees. This module is the second: the API
server may run an older CRD, and `afd render -f` reads files no server has seen. Field
names and defaults mirror the CRD; a test keeps the two in step.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from typing import Any, Literal, Optional, Union

from pydantic import Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from afd.config import SETTINGS, AttentionEngine, Dtype, KVCacheDtype, StageCount
from afd.config.sections import REASONING_PARSERS, TOOL_CALL_PARSERS
from afd.config.topology import Topology
from afd_operator.model.autoscaling import Autoscaling
from afd_operator.model.options import (
    DisruptionBudget, GangScheduling, ImagePullSecret, Monitoring, NetworkPolicy, Placement, PodSecurity, Ratio,
    SpecModel as _Model,
)

API_GROUP = "afd.io"
API_VERSION = "afd.io/v1alpha1"
KIND = "AFDDeployment"
PLURAL = "afddeployments"
# Bump when pods of the same spec stop being able to talk to pods rendered by an older
# operator (2: the group Secret joined the handshake digest); it enters every revision.
POD_CONTRACT = 2
SHUTDOWN_GRACE_ENV = SETTINGS["shutdown_grace_s"].env
DEFAULT_SHUTDOWN_GRACE_S = SETTINGS["shutdown_grace_s"].default
MAX_SHUTDOWN_GRACE_S = 3600.0
MAX_NAME_LENGTH = 40  # "<name>-g<NNN>-attn" must stay under the 52 characters a StatefulSet may use

Quantity = Union[int, float, str]
_MODEL_URI_RE = re.compile(
    r"^(?:pvc://(?P<claim>[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?)(?P<sub>/.*)?"
    r"|hf://(?P<repo>[^/\s@]+/[^/\s@]+)(?:@(?P<rev>\S+))?"
    r"|(?:file://)?(?P<path>/\S*))$"
)


class SpecError(ValueError):
    """An AFDDeployment spec the operator cannot act on; the message names every bad field."""


class Toleration(_Model):
    key: Optional[str] = None
    operator: Optional[Literal["Exists", "Equal"]] = None
    value: Optional[str] = None
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = None
    toleration_seconds: Optional[int] = None


class EnvVar(_Model):
    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str = ""


class Resources(_Model):
    limits: dict[str, Quantity] = Field(default_factory=dict)
    requests: dict[str, Quantity] = Field(default_factory=dict)


class RoleSpec(_Model):
    """One role of a group: how many ranks (one pod each) and what each pod gets."""

    ranks: int = Field(default=1, ge=1, le=256)
    resources: Resources = Field(default_factory=Resources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    env: list[EnvVar] = Field(default_factory=list)


class FFNRoleSpec(RoleSpec):
    """The FFN role: its ranks, and the shards (pods, one GPU each) of each rank."""

    expert_parallel: int = Field(default=1, ge=1, le=64)

    @property
    def pods(self) -> int:
        """Pods of the role per group: rank r's shard s is pod r·expertParallel + s."""
        return self.ranks * self.expert_parallel


class SecretKeyRef(_Model):
    name: str
    key: str = "HF_TOKEN"


class ModelCache(_Model):
    claim_name: Optional[str] = None
    size_limit: Optional[str] = None


class ModelSource(_Model):
    """Where the checkpoint comes from: `pvc://claim/dir`, `hf://org/name[@rev]` or a host path."""

    uri: str
    cache: ModelCache = Field(default_factory=ModelCache)
    secret_ref: Optional[SecretKeyRef] = None
    # the hf:// download init container's; empty: rendering.pod.DOWNLOAD_RESOURCES
    download_resources: Resources = Field(default_factory=Resources)

    @model_validator(mode="after")
    def _check_uri(self) -> "ModelSource":
        if not _MODEL_URI_RE.match(self.uri):
            raise ValueError(
                f"model.uri {self.uri!r}: expected pvc://<claim>[/dir], hf://<org>/<name>[@revision] "
                "or an absolute host path"
            )
        return self

    @property
    def kind(self) -> Literal["pvc", "hf", "host"]:
        match = _MODEL_URI_RE.match(self.uri)
        assert match is not None
        return "pvc" if match["claim"] else "hf" if match["repo"] else "host"

    @property
    def default_served_name(self) -> str:
        """The model id to serve when the spec names none: the hub id, else the last path
        element (the claim name for a bare pvc://claim)."""
        parts = self.parts
        if parts["repo"]:
            return parts["repo"]
        tail = (parts["sub"] if parts["claim"] else parts["path"]) or ""
        return tail.rstrip("/").rsplit("/", 1)[-1] or parts["claim"] or "model"

    @property
    def parts(self) -> dict[str, Optional[str]]:
        """The named pieces of the URI: claim/sub, repo/rev or path."""
        match = _MODEL_URI_RE.match(self.uri)
        assert match is not None
        return match.groupdict()


class CudaGraphs(_Model):
    enabled: bool = False


def _runtime(name: str, **bounds: Any) -> Any:
    """A field that is the runtime setting `name` (afd.config.SETTINGS): its default is the runtime's, never a
    copy; its bounds may be tighter than the runtime's, never wider (tests/operator/test_settings_render.py)."""
    return Field(default=SETTINGS[name].default, **bounds)


class AFDSettings(_Model):
    """The runtime knobs of docs/configuration.md that the whole group shares (same names as the runtime's
    settings where they are one: rendering/children.py writes those into the group's ConfigMap)."""

    connector: Literal["zmq", "nccl"] = _runtime("connector")  # not loopback: that one is for tests
    stages: StageCount = _runtime("stages")
    compute_gate_on_attention: bool = SETTINGS["gate_on_attention"].default
    cuda_graphs: CudaGraphs = Field(default_factory=CudaGraphs)
    dtype: Dtype = _runtime("dtype")
    max_num_seqs: int = _runtime("max_num_seqs", ge=1)
    max_model_len: int = _runtime("max_model_len", ge=0)
    dbo_min_tokens: int = _runtime("dbo_min_tokens", ge=0)
    max_num_batched_tokens: int = _runtime("max_num_batched_tokens", ge=1, le=1 << 20)
    prefill_itl_ratio: float = _runtime("prefill_itl_ratio", ge=0, le=100)
    api_servers: int = Field(default=0, ge=0, le=16)  # 0: the API in the engine's process (the runtime's api_process off)
    kv_cache_bytes: int = _runtime("kv_cache_bytes", ge=0, le=1 << 50)
    gpu_memory_utilization: float = _runtime("gpu_memory_utilization", ge=0.01, le=1)
    kv_cache_dtype: KVCacheDtype = _runtime("kv_cache_dtype")
    prefix_caching: bool = _runtime("prefix_caching")
    attention_engine: AttentionEngine = _runtime("attention_engine")
    attention_image: Optional[str] = None
    vllm_args: list[str] = Field(default_factory=list)

    def runtime(self) -> dict[str, Any]:
        """These knobs as the runtime's settings (afd.config names and types): what the group's pods run with.
        The API processes are not here: `api_servers` 0 means none (rendering/children.py writes api_process
        only when set)."""
        values = {name: getattr(self, name) for name in type(self).model_fields if name in SETTINGS}
        values.update(gate_on_attention=self.compute_gate_on_attention, cuda_graphs=self.cuda_graphs.enabled,
                      vllm_args=shlex.join(self.vllm_args))
        del values["api_servers"]
        return values

    @model_validator(mode="after")
    def _check_engine(self) -> "AFDSettings":
        if self.attention_engine == "vllm" and self.connector != "zmq":
            raise ValueError("afd.attentionEngine=vllm needs afd.connector=zmq (the vLLM plugin uses the host data plane)")
        return self


class SecretKeyRef(_Model):
    """One key of a Secret in the resource's namespace."""

    name: str = Field(min_length=1, max_length=253)
    key: str = Field(default="api-key", min_length=1, max_length=253)


class ApiSettings(_Model):
    """The OpenAI API of the attention pods."""

    # the runtime's `api_key`: the pods read it from this Secret (env valueFrom), never from the ConfigMap
    api_key_secret_ref: Optional[SecretKeyRef] = None
    # the runtime's `tool_call_parser` and `reasoning_parser` (unset: the runtime's default)
    tool_call_parser: Optional[Literal["none", *TOOL_CALL_PARSERS]] = None
    reasoning_parser: Optional[Literal[REASONING_PARSERS]] = None


class RouterSpec(_Model):
    """The front door as a Deployment (`afd route`): the client Service's endpoint when enabled, spreading requests
    over the Ready attention ranks of every group by prefix and load, moving streams whose rank dies."""

    enabled: bool = False
    replicas: int = Field(default=2, ge=1, le=100)
    port: int = Field(default=8000, ge=1, le=65535)
    metrics_port: int = Field(default=9090, ge=1, le=65535)
    max_unavailable: int = Field(default=1, ge=0, le=100)
    resources: Resources = Field(default_factory=Resources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    env: list[EnvVar] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_ports(self) -> "RouterSpec":
        if self.port == self.metrics_port:
            raise ValueError(f"router.port and router.metricsPort must differ (both {self.port})")
        return self


class Ports(_Model):
    http: int = Field(default=8000, ge=1, le=65535)
    metrics: int = Field(default=9090, ge=1, le=65535)
    control: int = Field(default=25500, ge=1, le=65535)
    data: int = Field(default=25501, ge=1, le=65535)

    @model_validator(mode="after")
    def _check_distinct(self) -> "Ports":
        ffn = {"control": self.control, "data": self.data, "metrics": self.metrics}
        attention = {"http": self.http, "metrics": self.metrics}
        for role, ports in (("FFN", ffn), ("attention", attention)):
            if len(set(ports.values())) != len(ports):
                raise ValueError(f"ports: the {role} ports {ports} must be distinct")
        return self


class Probes(_Model):
    period_seconds: int = Field(default=5, ge=1)
    startup_timeout_seconds: int = Field(default=3600, ge=10)


class Rollout(_Model):
    """Rollouts replace whole groups; both bounds count groups, never pods."""

    max_surge: int = Field(default=0, ge=0, le=100)
    max_unavailable: int = Field(default=1, ge=0, le=100)
    partition: int = Field(default=0, ge=0, le=100)

    @model_validator(mode="after")
    def _check_progress(self) -> "Rollout":
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError("rollout.maxSurge and rollout.maxUnavailable must not both be 0")
        return self


class RestartPolicy(_Model):
    """What the operator does when a rank of a group is lost."""

    type: Optional[Literal["RecreateGroupOnRankFailure", "None"]] = None
    backoff_seconds: int = Field(default=30, ge=0, le=86400)
    max_backoff_seconds: int = Field(default=600, ge=0, le=86400)
    max_restarts: Optional[int] = Field(default=None, ge=0, le=1_000_000)

    @model_validator(mode="after")
    def _check_backoff(self) -> "RestartPolicy":
        if self.max_backoff_seconds < self.backoff_seconds:
            raise ValueError(
                f"restartPolicy.maxBackoffSeconds ({self.max_backoff_seconds}) must not be below "
                f"restartPolicy.backoffSeconds ({self.backoff_seconds})"
            )
        return self


class AFDDeploymentSpec(_Model):
    """The whole spec of one AFDDeployment: `replicas` identical AFD groups."""

    replicas: int = Field(default=1, ge=0, le=100)
    image: str = Field(min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: list[ImagePullSecret] = Field(default_factory=list)
    service_account_name: Optional[str] = None
    priority_class_name: Optional[str] = None
    shm_size_limit: Optional[str] = None
    model: ModelSource
    served_model_name: Optional[str] = Field(default=None, min_length=1, max_length=256)
    attention: RoleSpec = Field(default_factory=RoleSpec)
    ffn: FFNRoleSpec = Field(default_factory=FFNRoleSpec)
    afd: AFDSettings = Field(default_factory=AFDSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    router: RouterSpec = Field(default_factory=RouterSpec)
    ports: Ports = Field(default_factory=Ports)
    probes: Probes = Field(default_factory=Probes)
    rollout: Rollout = Field(default_factory=Rollout)
    restart_policy: RestartPolicy = Field(default_factory=RestartPolicy)
    gang_scheduling: GangScheduling = Field(default_factory=GangScheduling)
    placement: Optional[Placement] = None
    pod_disruption_budget: DisruptionBudget = Field(default_factory=DisruptionBudget)
    monitoring: Monitoring = Field(default_factory=Monitoring)
    pod_security: PodSecurity = Field(default_factory=PodSecurity)
    network_policy: NetworkPolicy = Field(default_factory=NetworkPolicy)
    ratio: Ratio = Field(default_factory=Ratio)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)

    @model_validator(mode="after")
    def _check_shape(self) -> "AFDDeploymentSpec":
        if self.ffn.ranks > self.attention.ranks:
            raise ValueError(
                f"ffn.ranks ({self.ffn.ranks}) must not exceed attention.ranks ({self.attention.ranks})"
            )
        if self.ffn.expert_parallel > 1 and self.afd.attention_engine == "vllm":
            raise ValueError("ffn.expertParallel > 1 needs afd.attentionEngine=afd (the vLLM plugin links to "
                             "unsharded FFN ranks only)")
        self.shutdown_grace_seconds  # noqa: B018 (a bad value is a spec error, not a render error)
        return self

    @property
    def shutdown_grace_seconds(self) -> float:
        """The attention runtime's `AFD_SHUTDOWN_GRACE_S` (from `attention.env`, else its default):
        in-flight requests finish within it after SIGTERM; the pods' grace period must cover it."""
        raw = next((e.value for e in reversed(self.attention.env) if e.name == SHUTDOWN_GRACE_ENV), None)
        if raw is None:
            return DEFAULT_SHUTDOWN_GRACE_S
        try:
            grace = float(raw)
        except ValueError:
            raise ValueError(f"attention.env {SHUTDOWN_GRACE_ENV}={raw!r}: not a number of seconds") from None
        if not 0 <= grace <= MAX_SHUTDOWN_GRACE_S:
            raise ValueError(f"attention.env {SHUTDOWN_GRACE_ENV}={raw!r}: must be in 0..{MAX_SHUTDOWN_GRACE_S:g} seconds")
        return grace

    def pods(self, role: str) -> int:
        """Pods of `role` per group (an FFN rank of G shards is G pods)."""
        return self.attention.ranks if role == "attention" else self.ffn.pods

    @property
    def topology(self) -> Topology:
        return Topology(self.attention.ranks, self.ffn.ranks)

    @property
    def restart_type(self) -> str:
        """The effective restart policy; unset: None for either connector. The runtime rebuilds a lost
        rank's link in place (a fresh NCCL pair on GPU) and holds its requests until then (issue 38),
        while replacing the group would end every request its attention ranks hold."""
        return self.restart_policy.type or "None"

    @property
    def revision(self) -> str:
        """Hash of everything that shapes a group's pods (not replicas, rollout or restarts).

        Only values that differ from the defaults enter the hash, so spelling out a
        default, or an operator upgrade adding a defaulted field, starts no rollout. An
        operator upgrade that changes what the pods need of each other (POD_CONTRACT) does:
        a rank recreated from the new template must never join peers from the old one.
        """
        pod_fields = set(type(self).model_fields) - {
            "replicas", "rollout", "restart_policy", "pod_disruption_budget", "monitoring",
            "network_policy", "ratio", "autoscaling", "router",
        }
        data = self.model_dump(include=pod_fields, exclude_defaults=True, by_alias=True, mode="json")
        data = {"spec": data, "podContract": POD_CONTRACT}
        digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
        return digest[:10]


class Owner(_Model):
    """The identity of the custom resource, for names, labels and ownerReferences."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def parse_spec(spec: Any) -> AFDDeploymentSpec:
    """Parse a spec mapping; every problem is reported in one `SpecError`."""
    try:
        return AFDDeploymentSpec.model_validate(dict(spec or {}))
    except ValidationError as err:
        raise SpecError("; ".join(_describe(e) for e in err.errors())) from None


def parse_owner(body: Any) -> Owner:
    meta = body.get("metadata", {})
    name = meta.get("name", "")
    if len(name) > MAX_NAME_LENGTH:
        raise SpecError(
            f"metadata.name {name!r} is {len(name)} characters; an AFDDeployment name may have at "
            f"most {MAX_NAME_LENGTH} so that its StatefulSet and pod names stay valid"
        )
    return Owner(name=name, namespace=meta.get("namespace") or "default", uid=meta.get("uid", ""))


def _describe(error: dict[str, Any]) -> str:
    message = str(error["msg"]).removeprefix("Value error, ")
    location = ".".join(_camel(part) for part in error["loc"])
    if location and not message.startswith(location.split(".")[0]):
        return f"spec.{location}: {message}"
    return message


def _camel(part: Any) -> str:
    return to_camel(part) if isinstance(part, str) else f"[{part}]"
