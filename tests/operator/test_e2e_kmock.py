"""End to end: the real kopf operator against a kmock API server.

kmock serves only what is registered and does no validation, defaulting, garbage
collection or StatefulSet control; `kmock_cluster` adds server-side-apply creation and a
fake StatefulSet controller that the tests drive explicitly.
"""

from __future__ import annotations

import asyncio
import threading
import time

import kopf
import pytest
import pytest_asyncio

from afd_operator.handlers import OperatorMemo, build_registry
from afd_operator.model.spec import parse_spec
from kmock_cluster import (
    CR_PATH, NS, ApplyingEmulator, eventually, get, items, register, run_statefulsets, send,
    write_kubeconfig,
)
from op_testkit import make_cr

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60), pytest.mark.kmock(cls=ApplyingEmulator)]
STS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
PODS = f"/api/v1/namespaces/{NS}/pods"


@pytest_asyncio.fixture
async def operator(kmock, tmp_path, monkeypatch):
    """A running operator (standalone, all namespaces) talking to kmock through a kubeconfig.

    It runs in a thread with its own event loop, as in production: kopf cancels every
    other task of its loop when it stops, which would include pytest's own."""
    register(kmock)
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", str(kmock.url))))
    stop = threading.Event()
    memo = OperatorMemo()
    thread = threading.Thread(target=asyncio.run, name="afd-operator", args=(kopf.operator(
        registry=build_registry(resync_seconds=0.2), memo=memo, clusterwide=True, standalone=True,
        stop_flag=stop,
    ),))
    thread.start()
    yield memo
    stop.set()
    await asyncio.to_thread(thread.join, 15)  # keep serving kmock while the operator stops
    assert not thread.is_alive(), "the operator did not stop"


async def create(kmock, **spec):
    body = make_cr(**spec)
    body["metadata"]["resourceVersion"] = "1"  # kopf's JSON patches test it; kmock never bumps it
    await send(kmock, "POST", CR_PATH, body)
    return body


async def status(kmock, name="demo"):
    return (await get(kmock, f"{CR_PATH}/{name}") or {}).get("status") or {}


def condition(st, type_):
    return next((c for c in st.get("conditions", []) if c["type"] == type_), {})


async def events(kmock, reason):
    return [e for e in await items(kmock, f"/api/v1/namespaces/{NS}/events") if e.get("reason") == reason]


async def sts_names(kmock):
    return sorted(s["metadata"]["name"] for s in await items(kmock, STS))


async def ready_condition(kmock, value="True"):
    return condition(await status(kmock), "Ready").get("status") == value


async def test_create_renders_owned_children_and_reports_ready(kmock, operator):
    body = await create(kmock, attention={"ranks": 2}, ffn={"ranks": 1})
    await eventually(lambda: _has(kmock, STS, 2))
    assert await sts_names(kmock) == ["demo-g0-attn", "demo-g0-ffn"]
    for path in (STS, f"/api/v1/namespaces/{NS}/services", f"/api/v1/namespaces/{NS}/configmaps"):
        for obj in await items(kmock, path):
            [ref] = obj["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["uid"], ref["controller"]) == ("AFDDeployment", body["metadata"]["uid"], True)
    services = sorted(s["metadata"]["name"] for s in await items(kmock, f"/api/v1/namespaces/{NS}/services"))
    assert services == ["demo", "demo-g0-attn", "demo-g0-ffn"]
    attn = await get(kmock, f"{STS}/demo-g0-attn")
    env = {e["name"]: e.get("value") for e in attn["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AFD_ROLE"] == "attention" and env["AFD_NUM_ATTENTION_RANKS"] == "2"
    assert env["AFD_FFN_ADDRESS_TEMPLATE"] == "demo-g0-ffn-{rank}.demo-g0-ffn.ns.svc"

    st = await status(kmock)
    assert condition(st, "Ready")["status"] == "False" and st["updateRevision"]
    await run_statefulsets(kmock)
    await eventually(lambda: ready_condition(kmock))
    st = await status(kmock)
    assert (st["replicas"], st["readyReplicas"], st["groupsReady"], st["topology"]) == (1, 1, "1/1", "2A1F")
    assert st["attention"] == {"desired": 2, "ready": 2} and st["ffn"] == {"desired": 1, "ready": 1}
    assert st["selector"] == "afd.io/name=demo,afd.io/role=attention"
    assert condition(st, "Available")["status"] == "True"
    assert condition(st, "Progressing")["reason"] == "Complete"
    assert await eventually(lambda: events(kmock, "GroupCreated"))
    meta = (await get(kmock, f"{CR_PATH}/demo"))["metadata"]
    assert not meta.get("finalizers"), meta  # deletion never waits for the operator


async def test_scale_subresource_adds_and_removes_groups(kmock, operator):
    await create(kmock)
    await eventually(lambda: _has(kmock, STS, 2))
    await send(kmock, "PATCH", f"{CR_PATH}/demo/scale", {"spec": {"replicas": 2}})
    await eventually(lambda: _has(kmock, STS, 4))
    assert await sts_names(kmock) == ["demo-g0-attn", "demo-g0-ffn", "demo-g1-attn", "demo-g1-ffn"]
    await run_statefulsets(kmock)
    await eventually(lambda: ready_condition(kmock))
    assert (await status(kmock))["groupsReady"] == "2/2"

    await send(kmock, "PATCH", f"{CR_PATH}/demo/scale", {"spec": {"replicas": 1}})
    await eventually(lambda: _has(kmock, STS, 2))
    assert await sts_names(kmock) == ["demo-g0-attn", "demo-g0-ffn"]
    assert await eventually(lambda: events(kmock, "GroupDeleted"))


async def test_image_change_rolls_one_whole_group_at_a_time(kmock, operator):
    await create(kmock, replicas=2, rollout={"maxUnavailable": 1})
    await eventually(lambda: _has(kmock, STS, 4))
    await run_statefulsets(kmock)
    await eventually(lambda: ready_condition(kmock))
    old_revision = (await status(kmock))["updateRevision"]

    new_image = "registry.example/afd-runtime:0.2.0"
    await send(kmock, "PATCH", f"{CR_PATH}/demo", {"metadata": {"generation": 2}, "spec": {"image": new_image}})
    new_revision = parse_spec(make_cr(replicas=2, image=new_image)["spec"]).revision
    await eventually(lambda: _group_pods_gone(kmock, 1))  # the highest group goes first, all its ranks at once
    st = await eventually(lambda: _status_with(kmock, updateRevision=new_revision))
    assert st["currentRevision"] == old_revision
    assert condition(st, "Ready")["reason"] == "RolloutInProgress"
    assert condition(st, "Available")["status"] == "True"  # one group still serves
    assert await _images(kmock) == {0: {"registry.example/afd-runtime:0.1.0"}, 1: {new_image}}
    assert {p["metadata"]["labels"]["afd.io/revision"] for p in await items(kmock, PODS)} == {old_revision}

    await asyncio.sleep(0.6)  # a few resyncs: group 0 must wait until group 1 is Ready again
    assert await _images(kmock) == {0: {"registry.example/afd-runtime:0.1.0"}, 1: {new_image}}
    await run_statefulsets(kmock)  # group 1 comes back at the new revision
    await eventually(lambda: _group_pods_gone(kmock, 0))
    await run_statefulsets(kmock)
    await eventually(lambda: ready_condition(kmock))
    st = await status(kmock)
    assert st["currentRevision"] == st["updateRevision"] == new_revision and st["updatedReplicas"] == 2
    assert await _images(kmock) == {0: {new_image}, 1: {new_image}}
    pods = await items(kmock, PODS)
    for group in ("0", "1"):  # never a mixed group
        assert {p["metadata"]["labels"]["afd.io/revision"] for p in pods
                if p["metadata"]["labels"]["afd.io/group"] == group} == {new_revision}
    assert len(await events(kmock, "GroupReplaced")) == 2


async def test_lost_rank_restarts_the_group_with_backoff(kmock, operator):
    # 5 s: the second loss must be seen inside the backoff even on a loaded machine.
    await create(kmock, afd={"connector": "nccl"}, restartPolicy={"type": "RecreateGroupOnRankFailure", "backoffSeconds": 5, "maxBackoffSeconds": 10})
    await eventually(lambda: _has(kmock, STS, 2))
    await run_statefulsets(kmock)
    await eventually(lambda: ready_condition(kmock))

    await send(kmock, "DELETE", f"{PODS}/demo-g0-ffn-0")  # an FFN rank dies
    await eventually(lambda: _group_pods_gone(kmock, 0))  # first restart: immediate, every rank
    st = await eventually(lambda: _group_with(kmock, restarts=1))
    assert st["phase"] == "Restarting"
    [event] = await eventually(lambda: events(kmock, "GroupRestarted"))
    assert event["type"] == "Warning" and "missing" in event["message"]

    await run_statefulsets(kmock)
    await eventually(lambda: ready_condition(kmock))
    await send(kmock, "DELETE", f"{PODS}/demo-g0-attn-1")
    lost_at = time.monotonic()
    await eventually(lambda: _phase(kmock, "BackingOff"))
    assert len(await items(kmock, PODS)) == 2  # waits: the second restart is 5 s after the first
    await eventually(lambda: _group_pods_gone(kmock, 0), timeout=15)
    await eventually(lambda: _group_with(kmock, restarts=2))
    assert time.monotonic() - lost_at > 0.5


async def test_pending_pods_never_trigger_a_restart(kmock, operator):
    await create(kmock, afd={"connector": "nccl"}, restartPolicy={"type": "RecreateGroupOnRankFailure", "backoffSeconds": 0, "maxBackoffSeconds": 0})
    await eventually(lambda: _has(kmock, STS, 2))
    await run_statefulsets(kmock)
    await eventually(lambda: ready_condition(kmock))
    await send(kmock, "DELETE", f"{PODS}/demo-g0-ffn-0")
    await eventually(lambda: _group_pods_gone(kmock, 0))
    await eventually(lambda: _group_with(kmock, restarts=1))
    created = await run_statefulsets(kmock, ready=False)
    await send(kmock, "PATCH", f"{PODS}/{created[0]}", {"status": {"phase": "Pending"}})
    await asyncio.sleep(1.0)  # five resyncs
    assert len(await items(kmock, PODS)) == 3 and await _group_with(kmock, restarts=1)


async def test_invalid_spec_gets_a_condition_and_an_event_and_nothing_applied(kmock, operator):
    await create(kmock, attention={"ranks": 2}, ffn={"ranks": 3})  # kmock, like an old CRD, lets it in
    await eventually(lambda: _degraded(kmock))
    st = await status(kmock)
    assert condition(st, "Degraded")["reason"] == "InvalidSpec"
    assert "ffn.ranks (3) must not exceed attention.ranks (2)" in condition(st, "Ready")["message"]
    [event] = await eventually(lambda: events(kmock, "InvalidSpec"))
    assert event["type"] == "Warning" and "ffn.ranks (3)" in event["message"]
    await asyncio.sleep(0.6)
    assert await items(kmock, STS) == [] and await items(kmock, f"/api/v1/namespaces/{NS}/services") == []
    assert len(await events(kmock, "InvalidSpec")) == 1  # not one per resync


async def test_deleting_the_resource_is_not_blocked_and_the_operator_forgets_it(kmock, operator):
    body = await create(kmock)
    await eventually(lambda: _has(kmock, STS, 2))
    await send(kmock, "DELETE", f"{CR_PATH}/demo")
    await eventually(lambda: _gone(kmock, f"{CR_PATH}/demo"))
    await eventually(lambda: body["metadata"]["uid"] not in operator.last_status)
    # Children go with it through garbage collection (kmock has none): they name it as owner.
    for sts in await items(kmock, STS):
        assert sts["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]


async def _status_with(kmock, **fields):
    st = await status(kmock)
    return st if all(st.get(k) == v for k, v in fields.items()) else None


async def _group_with(kmock, index=0, **fields):
    groups = {g["index"]: g for g in (await status(kmock)).get("groups") or []}
    group = groups.get(index) or {}
    return group if all(group.get(k) == v for k, v in fields.items()) else None


async def _has(kmock, path, count):
    return len(await items(kmock, path)) == count


async def _gone(kmock, path):
    return await get(kmock, path) is None


async def _group_pods_gone(kmock, group):
    return not [p for p in await items(kmock, PODS) if p["metadata"]["labels"]["afd.io/group"] == str(group)]


async def _phase(kmock, phase):
    groups = (await status(kmock)).get("groups") or [{}]
    return groups[0].get("phase") == phase


async def _degraded(kmock):
    return condition(await status(kmock), "Degraded").get("status") == "True"


async def _images(kmock):
    result: dict[int, set] = {}
    for sts in await items(kmock, STS):
        group = int(sts["metadata"]["labels"]["afd.io/group"])
        result.setdefault(group, set()).add(sts["spec"]["template"]["spec"]["containers"][0]["image"])
    return result
