"""`spec.autoscaling`: the number of groups from service levels (docs/autoscaling.md).

Field names and defaults mirror the CRD, whose CEL rules refuse the same cross-field
mistakes on the API server; this model refuses them for `afd render -f` and older CRDs.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field, model_validator

from afd_operator.model.options import SpecModel

BOUNDS_MESSAGE = "autoscaling.minGroups must not exceed autoscaling.maxGroups"
NO_TARGET_MESSAGE = ("autoscaling.enabled needs at least one target: ttftP90Seconds, itlP90Seconds, "
                     "waitingPerGroup or kvCacheUsage")
REPLICAS_MANAGED_MESSAGE = ("spec.replicas cannot change while spec.autoscaling.enabled is true: the autoscaler "
                            "owns the group count (set autoscaling.minGroups/maxGroups, or disable autoscaling first)")


class Targets(SpecModel):
    """Service levels the groups must meet; any subset, at least one when enabled."""

    ttft_p90_seconds: Optional[float] = Field(default=None, ge=0.001, le=3600, alias="ttftP90Seconds")
    itl_p90_seconds: Optional[float] = Field(default=None, ge=0.0001, le=60, alias="itlP90Seconds")
    waiting_per_group: Optional[float] = Field(default=None, ge=0, le=100000)
    kv_cache_usage: Optional[float] = Field(default=None, ge=0.01, le=1)

    def configured(self) -> dict[str, float]:
        """Signal name (as in status) → target, for the targets that are set."""
        values = {"ttftP90Seconds": self.ttft_p90_seconds, "itlP90Seconds": self.itl_p90_seconds,
                  "waitingPerGroup": self.waiting_per_group, "kvCacheUsage": self.kv_cache_usage}
        return {name: value for name, value in values.items() if value is not None}


class Autoscaling(SpecModel):
    """Groups added when a target is missed for `scaleUpWindowSeconds`, removed (drained first)
    when the load would fit in one group fewer with `scaleDownMarginPercent` to spare for
    `scaleDownWindowSeconds`; at most one change per `cooldownSeconds`."""

    enabled: bool = False
    min_groups: int = Field(default=1, ge=1, le=100)
    max_groups: int = Field(default=4, ge=1, le=100)
    targets: Targets = Field(default_factory=Targets)
    scale_up_window_seconds: int = Field(default=60, ge=0, le=3600)
    scale_down_window_seconds: int = Field(default=300, ge=0, le=86400)
    cooldown_seconds: int = Field(default=120, ge=0, le=86400)
    scale_down_margin_percent: int = Field(default=20, ge=0, le=90)
    sample_interval_seconds: int = Field(default=15, ge=5, le=3600)
    drain_timeout_seconds: int = Field(default=600, ge=0, le=86400)
    prometheus_url: Optional[str] = Field(default=None, alias="prometheusURL", max_length=2048,
                                          pattern=r"^https?://\S+$")

    @model_validator(mode="after")
    def _check(self) -> "Autoscaling":
        if self.min_groups > self.max_groups:
            raise ValueError(f"{BOUNDS_MESSAGE} ({self.min_groups} > {self.max_groups})")
        if self.enabled and not self.targets.configured():
            raise ValueError(NO_TARGET_MESSAGE)
        return self

    def clamp(self, groups: int) -> int:
        return max(self.min_groups, min(self.max_groups, groups))
