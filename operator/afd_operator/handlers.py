"""kopf wiring: thin adapters from kopf's callbacks to `reconcile.reconcile`.

Handlers live on a registry built by `build_registry()`, so a test can run a fresh
operator against a mock API without global state. Reconciles of one resource are
serialised (change handlers and the resync timer may fire together), and the status
this operator wrote last is preferred over a possibly stale body: the operator is the
only writer of status.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Optional

import kopf

from afd_operator import labels as L
from afd_operator.kube import KubeError, KubeStore, Store
from afd_operator.model import API_GROUP, PLURAL
from afd_operator.observe import PodFacts, pod_facts
from afd_operator.reconcile import Outcome, reconcile

VERSION = "v1alpha1"
RESYNC_ENV = "AFD_OPERATOR_RESYNC_SECONDS"
DEFAULT_RESYNC_SECONDS = 10.0


class OperatorMemo(kopf.Memo):
    """Process-wide state: the API store, per-resource locks, the last status written."""

    store: Optional[Store] = None
    locks: dict
    last_status: dict

    def __init__(self, store: Optional[Store] = None) -> None:
        super().__init__()
        self.store = store
        self.locks = {}
        self.last_status = {}


def build_registry(resync_seconds: Optional[float] = None) -> kopf.OperatorRegistry:
    """A registry with every handler of the operator."""
    registry = kopf.OperatorRegistry()
    interval = resync_seconds or float(os.environ.get(RESYNC_ENV, DEFAULT_RESYNC_SECONDS))
    resource = (API_GROUP, VERSION, PLURAL)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, memo: OperatorMemo, **_: Any) -> None:
        # Keep kopf's bookkeeping in annotations: status fields the CRD does not declare are pruned.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=API_GROUP, key="last-handled-configuration")
        settings.posting.loggers = False  # events are posted on purpose, not for every log line
        if memo.store is None:
            memo.store = KubeStore.from_environment()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Optional[kopf.ConnectionInfo]:
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.index("pods", labels={L.NAME: kopf.PRESENT, L.GROUP: kopf.PRESENT}, registry=registry)
    def pods_by_owner(namespace: str, labels: dict, body: Any, **_: Any) -> Optional[dict]:
        facts = pod_facts(body)
        return {(namespace, labels[L.NAME]): facts} if facts else None

    @kopf.on.resume(*resource, registry=registry)
    @kopf.on.create(*resource, registry=registry)
    @kopf.on.update(*resource, field="spec", registry=registry)
    async def on_change(body: kopf.Body, patch: kopf.Patch, memo: OperatorMemo,
                        pods_by_owner: kopf.Index, **_: Any) -> None:
        try:
            await _run(body, patch, memo, pods_by_owner, full=True)
        except KubeError as err:
            raise kopf.TemporaryError(str(err), delay=10) from err

    @kopf.timer(*resource, interval=interval, registry=registry)
    async def resync(body: kopf.Body, patch: kopf.Patch, memo: OperatorMemo,
                     pods_by_owner: kopf.Index, logger: logging.Logger, **_: Any) -> None:
        try:
            await _run(body, patch, memo, pods_by_owner, full=False)
        except KubeError as err:  # the next tick retries
            logger.warning("resync failed: %s", err)

    @kopf.on.delete(*resource, optional=True, registry=registry)  # optional: no finalizer
    def forget(body: kopf.Body, memo: OperatorMemo, **_: Any) -> None:
        # Children go with the resource through their ownerReferences (garbage collection).
        memo.locks.pop(body.metadata.uid, None)
        memo.last_status.pop(body.metadata.uid, None)

    return registry


async def _run(body: kopf.Body, patch: kopf.Patch, memo: OperatorMemo,
               index: kopf.Index, full: bool) -> Outcome:
    uid = body.metadata.uid
    lock = memo.locks.setdefault(uid, asyncio.Lock())
    async with lock:
        pods: list[PodFacts] = list(index.get((body.metadata.namespace, body.metadata.name), []))
        current = dict(body)
        current["status"] = memo.last_status.get(uid) or dict(body.get("status") or {})
        assert memo.store is not None
        outcome = await asyncio.to_thread(reconcile, current, pods, memo.store, time.time(), full)
        memo.last_status[uid] = outcome.status
        patch["status"] = outcome.status
        for event in outcome.events:
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        return outcome
