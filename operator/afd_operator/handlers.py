"""kopf wiring: thin adapters from kopf's callbacks to `reconcile.deployment.reconcile`.

Handlers live on a registry built by `build_registry()`, so a test can run a fresh
operator against a mock API without global state. Spec changes reconcile at once; a
resync loop re-reconciles every resource periodically (and soon after any of its pods
changes) to follow readiness, rank losses and backoffs. The loop is ours, not a kopf
timer: kopf puts a finalizer on every resource with a timer, and then a stopped
operator would block `kubectl delete`. Children go with the resource through their
ownerReferences, so no finalizer is needed at all.

Reconciles of one resource are serialised, and the status this operator wrote last is
preferred over a possibly stale body: the reconciler is the only writer of status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

import kopf

from afd.config import process_setting
from afd_operator.model import labels as L
from afd_operator.apiserver import KubeError, KubeStore, Store
from afd_operator.metrics import OperatorMetrics
from afd_operator.model.spec import API_GROUP, PLURAL
from afd_operator.groups.observe import pod_facts
from afd_operator.ratio.feed import RatioFeed
from afd_operator.reconcile.deployment import Outcome, reconcile
from afd_operator.autoscaler.feed import ServiceFeed

VERSION = "v1alpha1"
RESYNC_ENV = "AFD_OPERATOR_RESYNC_SECONDS"  # default and check: afd.config.PROCESS_VARIABLES
log = logging.getLogger(__name__)


class OperatorMemo(kopf.Memo):
    """Process-wide state shared by all handlers (kopf hands out shallow copies, so the
    containers are shared). No class-level attributes: they would shadow Memo's keys."""

    def __init__(self, store: Optional[Store] = None, metrics: Optional[OperatorMetrics] = None) -> None:
        super().__init__()
        self.store = store
        self.metrics = metrics if metrics is not None else OperatorMetrics()
        self.locks: dict[str, asyncio.Lock] = {}
        self.last_status: dict[str, dict] = {}
        self.bodies: dict[str, dict] = {}  # uid → latest body seen on the watch
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, owner) → name → PodFacts
        self.wakeup: Optional[asyncio.Event] = None
        self.feed = RatioFeed()  # spec.ratio's metric scrapes
        self.service = ServiceFeed()  # spec.autoscaling's serving samples, and the drain of leaving groups


def build_registry(resync_seconds: Optional[float] = None) -> kopf.OperatorRegistry:
    """A registry with every handler of the operator."""
    registry = kopf.OperatorRegistry()
    interval = resync_seconds or process_setting(RESYNC_ENV)
    resource = (API_GROUP, VERSION, PLURAL)

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: OperatorMemo, **_: Any) -> None:
        # Keep kopf's bookkeeping in annotations: status fields the CRD does not declare are pruned.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=API_GROUP, key="last-handled-configuration")
        settings.posting.enabled = False  # the reconciler posts its own events, not log lines
        if memo.store is None:
            memo.store = await asyncio.to_thread(KubeStore.from_environment)
        memo.wakeup = asyncio.Event()
        memo.resync_task = asyncio.create_task(_resync_forever(memo, interval), name="afd-resync")

    @kopf.on.cleanup(registry=registry)
    async def stop(memo: OperatorMemo, **_: Any) -> None:
        task = memo.get("resync_task")
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Optional[kopf.ConnectionInfo]:
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.event("pods", labels={L.NAME: kopf.PRESENT, L.GROUP: kopf.PRESENT}, registry=registry)
    async def pod_event(type: str, body: kopf.Body, memo: OperatorMemo, **_: Any) -> None:
        facts = pod_facts(body)
        if facts is None:
            return
        note_pod(memo.pods, (body.metadata.namespace, body.metadata.labels[L.NAME]), type, facts)
        if memo.wakeup is not None:
            memo.wakeup.set()

    @kopf.on.event(*resource, registry=registry)
    async def resource_event(type: str, body: kopf.Body, memo: OperatorMemo, **_: Any) -> None:
        uid = body.metadata.uid
        if type == "DELETED":
            for store in (memo.bodies, memo.last_status, memo.locks):
                store.pop(uid, None)
            memo.feed.forget(uid)
            memo.service.forget(uid)
            memo.metrics.forget(body.metadata.namespace, body.metadata.name)
        else:
            memo.bodies[uid] = dict(body)

    @kopf.on.resume(*resource, registry=registry)
    @kopf.on.create(*resource, registry=registry)
    @kopf.on.update(*resource, field="spec", registry=registry)
    async def on_change(body: kopf.Body, memo: OperatorMemo, **_: Any) -> None:
        try:
            await reconcile_one(memo, dict(body), full=True)
        except KubeError as err:
            raise kopf.TemporaryError(str(err), delay=10) from err

    return registry


def note_pod(pods: dict[tuple[str, str], dict[str, Any]], owner: tuple[str, str], type: str, facts: Any) -> None:
    """Keep `facts` of one pod under its (namespace, owner), or drop it when deleted; an owner whose
    last pod went is forgotten (a deleted resource's pods go last, so nothing of it stays behind)."""
    if type != "DELETED":
        pods.setdefault(owner, {})[facts.name] = facts
        return
    known = pods.get(owner, {})
    known.pop(facts.name, None)
    if not known:
        pods.pop(owner, None)


async def reconcile_one(memo: OperatorMemo, body: dict[str, Any], full: bool) -> Outcome:
    """Reconcile one resource under its lock; write the status only when it changed."""
    meta = body["metadata"]
    uid = meta["uid"]
    async with memo.locks.setdefault(uid, asyncio.Lock()):
        started, error, outcome = time.perf_counter(), "internal", None
        try:
            pods = list(memo.pods.get((meta["namespace"], meta["name"]), {}).values())
            current = {**body, "status": memo.last_status.get(uid) or dict(body.get("status") or {})}
            store = memo.store
            assert store is not None, "the startup handler sets the store"
            scrapes = await asyncio.to_thread(memo.feed.collect, current, pods, time.time())
            service = await asyncio.to_thread(memo.service.collect, current, pods, time.time())
            outcome = await asyncio.to_thread(reconcile, current, pods, store, time.time(), full, scrapes, service,
                                              memo.service.drain)
            if outcome.status != memo.last_status.get(uid):
                await asyncio.to_thread(store.patch_status, meta["namespace"], meta["name"], outcome.status)
                memo.last_status[uid] = outcome.status
            for event in outcome.events:
                await asyncio.to_thread(store.post_event, meta, event.type, event.reason, event.message)
            error = "invalid_spec" if _invalid_spec(outcome.status) else None
            return outcome
        except KubeError:
            error = "api"
            raise
        finally:
            memo.metrics.observe(meta["namespace"], meta["name"], time.perf_counter() - started, error,
                                 body.get("spec") or {}, outcome.status if outcome is not None else None)


def _invalid_spec(status: dict[str, Any]) -> bool:
    return any(c.get("type") == "Degraded" and c.get("reason") == "InvalidSpec"
               for c in status.get("conditions") or [])


async def _resync_forever(memo: OperatorMemo, interval: float) -> None:
    """Re-reconcile every known resource each `interval` seconds, or soon after a pod event."""
    assert memo.wakeup is not None
    while True:
        try:
            await asyncio.wait_for(memo.wakeup.wait(), timeout=interval)
            await asyncio.sleep(min(0.5, interval))  # let a burst of pod events settle
        except asyncio.TimeoutError:
            pass
        memo.wakeup.clear()
        for uid, body in list(memo.bodies.items()):
            if body.get("metadata", {}).get("deletionTimestamp"):
                continue
            try:
                await reconcile_one(memo, body, full=False)
            except KubeError as err:  # the next round retries
                # 404: deleted while this round ran (its DELETED event comes next), not a fault.
                level = logging.INFO if err.status == 404 else logging.WARNING
                log.log(level, "resync of %s/%s failed: %s", body["metadata"].get("namespace"),
                        body["metadata"].get("name"), err)
            except Exception:  # one broken resource must not stop the others' resyncs
                log.exception("resync of %s failed", uid)
