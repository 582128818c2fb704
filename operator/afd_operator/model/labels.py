"""Label keys and child names: the one place that knows how children are called."""

from __future__ import annotations

NAME = "afd.io/name"
GROUP = "afd.io/group"
ROLE = "afd.io/role"
REVISION = "afd.io/revision"
ROUTER = "afd.io/router"  # the router's pods carry this instead of afd.io/name, so no group selector takes them
COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = "app.kubernetes.io/managed-by"
OPERATOR = "afd-operator"  # also the server-side apply field manager

ROLES = ("attention", "ffn")
_ROLE_SUFFIX = {"attention": "attn", "ffn": "ffn"}


def group_name(name: str, index: int) -> str:
    return f"{name}-g{index}"


def role_name(name: str, index: int, role: str) -> str:
    """The StatefulSet and its headless Service share this name (pod DNS depends on it)."""
    return f"{group_name(name, index)}-{_ROLE_SUFFIX[role]}"


def config_name(name: str, index: int) -> str:
    return f"{group_name(name, index)}-config"


def podgroup_name(name: str, index: int) -> str:
    return group_name(name, index)


def secret_name(name: str) -> str:
    """The resource's Secret (AFD_GROUP_SECRET of every role pod, shared by all its groups)."""
    return f"{name}-group-secret"


def router_name(name: str) -> str:
    """The router's Deployment, PodDisruptionBudget and PodMonitor."""
    return f"{name}-router"


def ranks_name(name: str) -> str:
    """The headless Service over the Ready attention pods of every group: the router resolves it to find them."""
    return f"{name}-ranks"


def router_selector(name: str) -> dict[str, str]:
    return {ROUTER: name}


def router_pod_labels(name: str) -> dict[str, str]:
    """The router's pods: `afd.io/router`, not `afd.io/name`, so no selector of the groups takes them."""
    return {ROUTER: name, COMPONENT: "router", MANAGED_BY: OPERATOR}


def router_labels(name: str) -> dict[str, str]:
    """The router's objects (Deployment, PodDisruptionBudget, PodMonitor): listed with the resource's others."""
    return {NAME: name, **router_pod_labels(name)}


def shared_labels(name: str) -> dict[str, str]:
    """Labels of the objects shared by all groups of a resource."""
    return {NAME: name, MANAGED_BY: OPERATOR}


def group_labels(name: str, index: int, revision: str) -> dict[str, str]:
    return {NAME: name, GROUP: str(index), REVISION: revision, MANAGED_BY: OPERATOR}


def role_labels(name: str, index: int, role: str, revision: str) -> dict[str, str]:
    return {**group_labels(name, index, revision), ROLE: role}


def role_selector(name: str, index: int, role: str) -> dict[str, str]:
    """Stable selector of one role of one group: revisions change, selectors must not."""
    return {NAME: name, GROUP: str(index), ROLE: role}
