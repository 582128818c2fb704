"""End to end against kmock: the group Secret, the restart budget and the operator's metrics."""

from __future__ import annotations

import asyncio
import base64
import logging

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kmock_cluster import CR_PATH, NS, ApplyingEmulator, eventually, get, items, run_statefulsets, send
from test_e2e_kmock import (  # noqa: F401  (operator is a fixture)
    PODS, STS, _group_with, _has, condition, create, events, operator, ready_condition, status,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60), pytest.mark.kmock(cls=ApplyingEmulator)]
SECRET = f"/api/v1/namespaces/{NS}/secrets/demo-group-secret"


async def _secret_value(kmock):
    secret = await get(kmock, SECRET)
    return base64.b64decode(secret["data"]["group-secret"]).decode() if secret else None


async def test_the_group_secret_is_created_once_read_by_every_pod_and_never_logged(kmock, operator, caplog):
    caplog.set_level(logging.DEBUG)
    body = await create(kmock)
    await eventually(lambda: _has(kmock, STS, 2))
    value = await eventually(lambda: _secret_value(kmock))
    secret = await get(kmock, SECRET)
    assert len(bytes.fromhex(value)) == 32 and secret["immutable"] is True
    assert secret["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
    for sts in await items(kmock, STS):
        [container] = sts["spec"]["template"]["spec"]["containers"]
        [env] = [e for e in container["env"] if e["name"] == "AFD_GROUP_SECRET"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "demo-group-secret", "key": "group-secret"}

    await run_statefulsets(kmock)
    await eventually(lambda: ready_condition(kmock))
    # A spec change (a full reconcile and a rollout) and a few resyncs: the value stays.
    await send(kmock, "PATCH", f"{CR_PATH}/demo",
               {"metadata": {"generation": 2}, "spec": {"image": "registry.example/afd-runtime:0.2.0"}})
    await eventually(lambda: _images_are(kmock, "registry.example/afd-runtime:0.2.0"))
    await asyncio.sleep(0.6)
    assert await _secret_value(kmock) == value
    assert value not in caplog.text and secret["data"]["group-secret"] not in caplog.text
    st = await status(kmock)
    assert value not in repr(st)


async def test_an_exhausted_restart_budget_marks_the_group_failed_and_leaves_it(kmock, operator):
    await create(kmock, afd={"connector": "nccl"},
                 restartPolicy={"type": "RecreateGroupOnRankFailure", "backoffSeconds": 0, "maxBackoffSeconds": 20, "maxRestarts": 1})
    await eventually(lambda: _has(kmock, STS, 2))
    await run_statefulsets(kmock)
    await eventually(lambda: ready_condition(kmock))
    await send(kmock, "DELETE", f"{PODS}/demo-g0-ffn-0")
    await eventually(lambda: _group_with(kmock, restarts=1))  # the one restart the budget allows
    await eventually(lambda: _no_pods(kmock))
    await run_statefulsets(kmock)
    await eventually(lambda: ready_condition(kmock))

    await send(kmock, "DELETE", f"{PODS}/demo-g0-attn-1")  # lost again: budget spent
    await eventually(lambda: _group_with(kmock, phase="Failed"))
    st = await status(kmock)
    failed = condition(st, "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "RestartBudgetExhausted")
    assert "maxRestarts (1)" in failed["message"]
    [event] = await eventually(lambda: events(kmock, "GroupFailed"))
    assert event["type"] == "Warning"
    await asyncio.sleep(0.6)  # a few resyncs: no restart any more, the surviving pods stay
    assert len(await items(kmock, PODS)) == 2 and await _group_with(kmock, restarts=1, phase="Failed")
    registry = operator.metrics.registry
    assert registry.get_sample_value("afd_operator_groups", {"namespace": NS, "deployment": "demo",
                                                             "state": "failed"}) == 1


async def test_metrics_count_reconciles_errors_durations_and_groups(kmock, operator):
    await create(kmock, replicas=2)
    await eventually(lambda: _has(kmock, STS, 4))
    await run_statefulsets(kmock)
    await eventually(lambda: ready_condition(kmock))
    await asyncio.sleep(0.5)  # a resync after Ready updates the gauges
    labels = {"namespace": NS, "deployment": "demo"}
    registry = operator.metrics.registry
    sample = lambda name, **extra: registry.get_sample_value(name, {**labels, **extra})
    assert sample("afd_operator_reconcile_total", result="success") >= 2
    assert sample("afd_operator_reconcile_total", result="error") is None
    assert sample("afd_operator_reconcile_duration_seconds_count") == sample("afd_operator_reconcile_total",
                                                                            result="success")
    assert 0 < sample("afd_operator_reconcile_duration_seconds_sum") < 30
    assert sample("afd_operator_groups", state="desired") == 2
    assert sample("afd_operator_groups", state="ready") == 2
    assert sample("afd_operator_reconcile_errors_total", reason="invalid_spec") is None

    await send(kmock, "PATCH", f"{CR_PATH}/demo", {"metadata": {"generation": 2},
                                                   "spec": {"attention": {"ranks": 1}, "ffn": {"ranks": 2}}})
    await eventually(lambda: registry.get_sample_value(
        "afd_operator_reconcile_errors_total", {**labels, "reason": "invalid_spec"}))
    names = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert {"afd_operator_reconcile", "afd_operator_reconcile_errors",
            "afd_operator_reconcile_duration_seconds", "afd_operator_groups"} <= names

    await send(kmock, "DELETE", f"{CR_PATH}/demo")  # a deleted resource leaves no series behind
    await eventually(lambda: registry.get_sample_value("afd_operator_reconcile_duration_seconds_count",
                                                       labels) is None)
    assert "deployment=\"demo\"" not in generate_latest(registry).decode()


async def _images_are(kmock, image):
    images = {s["spec"]["template"]["spec"]["containers"][0]["image"] for s in await items(kmock, STS)}
    return images == {image}


async def _no_pods(kmock):
    return not await items(kmock, PODS)
