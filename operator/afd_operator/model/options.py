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


RATIO_ORDER_MESSAGE = "ratio.minAttentionPerFFN must not exceed ratio.maxAttentionPerFFN"


class Ratio(SpecModel):
    """Choosing the attention:FFN ratio from the groups' metrics (docs/ratio.md). Off: nothing;
    Advise: the recommendation goes to status and an Event; Auto: groups also move to it
    through the group rollout, above `minGainPercent`, at most once per `cooldownSeconds`."""

    mode: Literal["Off", "Advise", "Auto"] = "Off"
    min_attention_per_ffn: float = Field(default=1.0, ge=1, le=256, alias="minAttentionPerFFN")
    max_attention_per_ffn: float = Field(default=8.0, ge=1, le=256, alias="maxAttentionPerFFN")
    max_ranks_per_group: int = Field(default=16, ge=2, le=256)
    min_gain_percent: int = Field(default=15, ge=0, le=1000)
    cooldown_seconds: int = Field(default=3600, ge=0, le=604800)
    sample_interval_seconds: int = Field(default=30, ge=5, le=3600)
    samples: int = Field(default=6, ge=2, le=100)
    min_available: int = Field(default=1, ge=0, le=100)
    prometheus_url: Optional[str] = Field(default=None, alias="prometheusURL", max_length=2048, pattern=r"^https?://\S+$")

    @model_validator(mode="after")
    def _check_bounds(self) -> "Ratio":
        if self.min_attention_per_ffn > self.max_attention_per_ffn:
            raise ValueError(f"{RATIO_ORDER_MESSAGE} ({self.min_attention_per_ffn:g} > {self.max_attention_per_ffn:g})")
        return self
