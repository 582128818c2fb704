"""Reconcile the router of one AFDDeployment (`spec.router`): apply its objects, read how many of its pods are
Ready, and say whether the client Service may point at it.

The client Service moves to the router's pods once one of them is Ready, and back to the attention pods when the
router is disabled or none of its pods is Ready (a client is never sent to a Service with no endpoints because
the router is still starting). Disabling the router deletes its objects at the next full reconcile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from afd_operator.apiserver import Store
from afd_operator.model import labels as L
from afd_operator.model.spec import AFDDeploymentSpec, Owner
from afd_operator.rendering.router import render_router, router_kinds


@dataclass(frozen=True)
class RouterState:
    """Whether the client Service points at the router, and `status.router` (None: no router)."""

    serving: bool
    status: Optional[dict[str, Any]]


def reconcile_router(spec: AFDDeploymentSpec, owner: Owner, store: Store, full: bool) -> RouterState:
    """Apply (or, at a full reconcile, prune) the router's objects; read its Deployment's Ready pods."""
    wanted = render_router(spec, owner)
    for obj in wanted:
        store.apply(obj)
    if full:
        kept = {(obj["kind"], obj["metadata"]["name"]) for obj in wanted}
        for api_version, kind, name_of in router_kinds():
            if (kind, name_of(owner.name)) not in kept:
                store.delete(api_version, kind, owner.namespace, name_of(owner.name))
    if not spec.router.enabled:
        return RouterState(False, None)
    deployment = store.get("apps/v1", "Deployment", owner.namespace, L.router_name(owner.name)) or {}
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
    return RouterState(ready > 0, {
        "replicas": spec.router.replicas,
        "readyReplicas": ready,
        "serving": ready > 0,
        "service": owner.name,
        "ranksService": L.ranks_name(owner.name),
    })
