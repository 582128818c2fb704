"""End to end with kopf and kmock: spec.autoscaling reads the attention ranks' metrics (a fake
HTTP getter standing in for the pods), adds a group when requests wait, and removes one by
draining it first: the /drain call, then the deletion once its ranks are unready and idle."""

from __future__ import annotations

import pytest

from kmock_cluster import ApplyingEmulator, eventually, items, run_statefulsets, send
from test_e2e_kmock import PODS, STS, create, events, operator, status  # noqa: F401 (fixture)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90), pytest.mark.kmock(cls=ApplyingEmulator)]
AUTOSCALING = {"enabled": True, "minGroups": 1, "maxGroups": 2, "targets": {"waitingPerGroup": 2},
               "scaleUpWindowSeconds": 0, "scaleDownWindowSeconds": 0, "cooldownSeconds": 0,
               "sampleIntervalSeconds": 5, "drainTimeoutSeconds": 600}


class Ranks:
    """Every attention rank's /metrics (`waiting` requests each) and the drain calls."""

    def __init__(self):
        self.waiting, self.drained = 0, []

    def get(self, url):
        if "/drain" in url:
            self.drained.append(url)
            return '{"status": "drained"}'
        return f'afd_requests_waiting{{role="attention",rank="0"}} {self.waiting}\n'


async def _sts(kmock):
    return sorted(s["metadata"]["name"] for s in await items(kmock, STS))


async def test_waiting_requests_add_a_group_and_a_quiet_one_is_drained_then_deleted(kmock, operator):  # noqa: F811
    ranks = Ranks()
    operator.service._get = ranks.get
    await create(kmock, autoscaling=AUTOSCALING)
    await eventually(lambda: _has_sts(kmock, 2))
    await run_statefulsets(kmock, ips=True)
    ranks.waiting = 5  # 10 waiting in the group, target 2 per group
    st = await eventually(lambda: _autoscaling(kmock, desiredGroups=2), timeout=30)
    assert st["signal"] == "waitingPerGroup"
    await eventually(lambda: _has_sts(kmock, 4))
    assert await eventually(lambda: events(kmock, "AutoscaleUp"))

    await run_statefulsets(kmock, ips=True)
    ranks.waiting = 0
    await eventually(lambda: _autoscaling(kmock, desiredGroups=1), timeout=30)
    await eventually(lambda: ranks.drained)
    leaving = {p["status"]["podIP"] for p in await items(kmock, PODS) if p["metadata"]["name"].startswith("demo-g1-attn")}
    assert {url.split("/")[2].split(":")[0] for url in ranks.drained} == leaving
    assert all(url.endswith(":9090/drain?seconds=0") for url in ranks.drained)
    group = next(g for g in (await status(kmock))["groups"] if g["index"] == 1)
    assert group["phase"] == "Draining" and await _sts(kmock) == ["demo-g0-attn", "demo-g0-ffn", "demo-g1-attn", "demo-g1-ffn"]

    for pod in ("demo-g1-attn-0", "demo-g1-attn-1"):  # the kubelet sees readiness fail: out of the Service
        await send(kmock, "PATCH", f"{PODS}/{pod}", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    await eventually(lambda: _has_sts(kmock, 2), timeout=30)
    assert await _sts(kmock) == ["demo-g0-attn", "demo-g0-ffn"]
    deleted = await eventually(lambda: events(kmock, "GroupDeleted"))
    assert "ScaleDown (drained)" in deleted[0]["message"]


async def _has_sts(kmock, count):
    return len(await items(kmock, STS)) == count


async def _autoscaling(kmock, **want):
    state = (await status(kmock)).get("autoscaling") or {}
    return state if all(state.get(k) == v for k, v in want.items()) else None
