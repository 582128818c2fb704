"""Pod hardening and the group secret in the pod. Pure.

Role pods run as a fixed non-root user with a read-only root filesystem, no privilege
escalation, no capabilities and the runtime's default seccomp profile (the Pod Security
Standards' "restricted" profile). What the runtime must write goes to emptyDirs: /tmp,
and a home directory that holds every cache (Hugging Face, torch, Triton, CUDA);
/dev/shm is the memory-backed volume of rendering.pod.
"""

from __future__ import annotations

import base64
from typing import Any

from afd_operator.model import labels as L
from afd_operator.model.spec import AFDDeploymentSpec, Owner

HOME_DIR = "/home/afd"  # the runtime image's home; mounted over, so any image works
TMP_DIR = "/tmp"
SECRET_KEY = "group-secret"
SECRET_ENV = "AFD_GROUP_SECRET"


def pod_security_context(spec: AFDDeploymentSpec) -> dict[str, Any]:
    """The pod-level securityContext: who every container runs as."""
    sec = spec.pod_security
    return {
        "runAsNonRoot": True,
        "runAsUser": sec.run_as_user,
        "runAsGroup": sec.run_as_group,
        "fsGroup": sec.fs_group,
        # Model PVCs hold hundreds of files: do not chown them all at every mount.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """The container-level securityContext, the same for every container of a role pod."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def scratch_env() -> list[dict[str, str]]:
    """Point every cache at the writable home (libraries fall back to ~/.cache otherwise)."""
    values = {
        "HOME": HOME_DIR,
        "XDG_CACHE_HOME": f"{HOME_DIR}/.cache",
        "HF_HOME": f"{HOME_DIR}/.cache/huggingface",
        "TMPDIR": TMP_DIR,
    }
    return [{"name": k, "value": v} for k, v in values.items()]


def scratch_mounts() -> list[dict[str, Any]]:
    return [{"name": "tmp", "mountPath": TMP_DIR}, {"name": "home", "mountPath": HOME_DIR}]


def scratch_volumes() -> list[dict[str, Any]]:
    """Disk-backed: caches and temporary files live as long as the pod, not the container."""
    return [{"name": "tmp", "emptyDir": {}}, {"name": "home", "emptyDir": {}}]


def group_secret_env(owner: Owner) -> dict[str, Any]:
    """AFD_GROUP_SECRET from the resource's Secret: the runtime folds it into the handshake
    digest with AFD_GROUP_TOKEN, so a pod without the Secret cannot join a group."""
    ref = {"name": L.secret_name(owner.name), "key": SECRET_KEY}
    return {"name": SECRET_ENV, "valueFrom": {"secretKeyRef": ref}}


def render_group_secret(owner: Owner, value: str) -> dict[str, Any]:
    """The resource's Secret holding `value`. Pure: the caller generates the value, once
    (secret.ensure_group_secret), so re-rendering never rotates it. Immutable: a changed
    value would split running pods from recreated ones; delete it to rotate."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {
            "name": L.secret_name(owner.name),
            "namespace": owner.namespace,
            "labels": L.shared_labels(owner.name),
            "ownerReferences": [owner.reference()],
        },
        "data": {SECRET_KEY: base64.b64encode(value.encode()).decode()},
    }
