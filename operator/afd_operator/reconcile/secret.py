"""The resource's group Secret: created once with a random value, never rotated. Acts.

Every role pod reads AFD_GROUP_SECRET from it; the runtime folds it into the handshake
digest, so a pod that cannot read the Secret cannot join a group. The value is made
here, and only when the Secret is missing: rendering stays pure and a reconcile never
changes a value that running pods hold. It is never logged and never enters a message.
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass
from typing import Any, Optional

from afd_operator.model import labels as L
from afd_operator.apiserver import KubeError, Store
from afd_operator.model.spec import Owner
from afd_operator.rendering.security import SECRET_KEY, render_group_secret

SECRET_BYTES = 32


@dataclass(frozen=True)
class SecretCheck:
    """What ensuring the Secret did: `created` (worth an event) or a `problem` for the status."""

    created: bool = False
    problem: str = ""


def new_secret_value() -> str:
    """32 random bytes, hex-encoded: environment variables carry text."""
    return secrets.token_hex(SECRET_BYTES)


def ensure_group_secret(store: Store, owner: Owner) -> SecretCheck:
    """Create the Secret when it is missing; adopt a leftover of an earlier resource of the
    same name; report one that pods cannot use. Never changes an existing value."""
    name = L.secret_name(owner.name)
    existing = store.get("v1", "Secret", owner.namespace, name)
    if existing is None:
        try:
            store.create(render_group_secret(owner, new_secret_value()))
            return SecretCheck(created=True)
        except KubeError as err:
            if err.status != 409:  # 409: created meanwhile (another reconcile); use that one
                raise
            existing = store.get("v1", "Secret", owner.namespace, name)
            if existing is None:
                raise KubeError(409, f"Secret {owner.namespace}/{name} exists and cannot be read") from None
    return SecretCheck(problem=_adopt(store, owner, existing))


def _adopt(store: Store, owner: Owner, existing: dict[str, Any]) -> str:
    meta = existing.get("metadata") or {}
    name = meta.get("name", L.secret_name(owner.name))
    labels = meta.get("labels") or {}
    if labels.get(L.MANAGED_BY) != L.OPERATOR or labels.get(L.NAME) != owner.name:
        return (f"Secret {name} exists but was not made by {L.OPERATOR} for {owner.name}: "
                f"rename or delete it, and the operator creates the group secret")
    if not _value(existing):
        return (f"Secret {name} has no non-empty key {SECRET_KEY!r}: delete it, the operator creates a "
                f"new one, then restart the groups so that every rank holds the new value")
    refs = meta.get("ownerReferences") or []
    if not any(r.get("uid") == owner.uid and r.get("controller") for r in refs):
        # Left by a deleted resource of the same name that garbage collection has not reached yet.
        store.patch("v1", "Secret", owner.namespace, name, {"metadata": {"ownerReferences": [owner.reference()]}})
    return ""


def _value(secret: dict[str, Any]) -> Optional[bytes]:
    data = (secret.get("data") or {}).get(SECRET_KEY)
    if not data:
        return None
    try:
        return base64.b64decode(data, validate=True) or None
    except ValueError:
        return None
