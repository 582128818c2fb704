"""The optional parts of an AFDDeployment spec: scheduling, placement, disruption budget,
monitoring, pod security and network isolation. Field names and defaults mirror the CRD.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

# The runtime image's user (images/runtime/Dockerfile: `useradd --uid 10001`).
DEFAULT_UID = 10001
MAX_ID = 2**31 - 1  # the largest uid/gid Kubernetes accepts


class SpecModel(BaseModel):
    """Base of every spec model: camelCase aliases, unknown fields refused, frozen."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class GangScheduling(SpecModel):
    enabled: bool = False
    scheduler: Literal["volcano", "scheduler-plugins"] = "volcano"
    scheduler_name: Optional[str] = None
    timeout_seconds: int = Field(default=60, ge=1)


class Placement(SpecModel):
    """Pack each group into one topology domain (a node, a rack, an NVLink domain)."""

    topology_key: str
    mode: Literal["Required", "Preferred"] = "Preferred"


class DisruptionBudget(SpecModel):
    enabled: bool = False
    max_unavailable: int = Field(default=1, ge=0)


class Monitoring(SpecModel):
    pod_monitor: bool = False
    interval: str = Field(default="15s", pattern=r"^[0-9]+(ms|s|m|h)$")


class ImagePullSecret(SpecModel):
    name: str


ROOT_UID_MESSAGE = "podSecurity.runAsUser must not be 0 (root): role pods run with runAsNonRoot"


class PodSecurity(SpecModel):
    """Who the role pods run as. They always run non-root, with a read-only root filesystem,
    no privilege escalation, no capabilities and the runtime's default seccomp profile."""

    run_as_user: int = Field(default=DEFAULT_UID, ge=0, le=MAX_ID)
    run_as_group: int = Field(default=DEFAULT_UID, ge=0, le=MAX_ID)
    fs_group: int = Field(default=DEFAULT_UID, ge=0, le=MAX_ID)

    @model_validator(mode="after")
    def _check_non_root(self) -> "PodSecurity":
        if self.run_as_user == 0:
            raise ValueError(ROOT_UID_MESSAGE)
        return self


class LabelSelector(SpecModel):
    match_labels: dict[str, str] = Field(default_factory=dict)


class NetworkPolicy(SpecModel):
    """Per-group NetworkPolicies: connector ports only from the same group, metrics from
    `metricsNamespaceSelector` (unset: the resource's own namespace), HTTP from anywhere."""

    enabled: bool = False
    metrics_namespace_selector: Optional[LabelSelector] = None
