"""Issue 22: readiness follows the FFN link at once, liveness does not, and the preStop drain
turns the pod unready while it keeps serving. The probe server here is the one `afd serve`
starts on the metrics port, wired by `attention_probes` exactly as there."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest
from prometheus_client import CollectorRegistry

from afd.local.children import free_port_block
from afd.server.probe_http import Probes, drain_seconds, start_probe_server
from afd.server.serve.engine_api import attention_probes
from tests.runtime.test_generate_cli import processes_with_marker
from tests.server.conftest import LiveServer, _free_port
from tests.server.test_faults import stream
from tests.server.test_up import wait_for


def _probe_server(probes: Probes):
    server = start_probe_server("127.0.0.1", _free_port(), probes, CollectorRegistry())
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _wait_for_status(url: str, status: int, timeout_s: float, step_s: float = 0.02) -> float | None:
    """Seconds until `url` answers `status`, or None if it did not within `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if httpx.get(url, timeout=2).status_code == status:
            return time.monotonic() - started
        time.sleep(step_s)
    return None


@pytest.fixture
def live_with_probes(checkpoints):
    live = LiveServer(checkpoints["qwen3_moe"])
    stop = threading.Event()
    probes = attention_probes(live.state, lambda: live.server.started, stop, lambda: live.role.link.ffn_draining)
    probe, probe_url = _probe_server(probes)
    yield live, probe_url, stop
    probe.shutdown()
    live.close()


def test_readiness_turns_503_within_a_second_of_losing_the_ffn_while_liveness_stays_200(live_with_probes):
    live, probe_url, _ = live_with_probes
    body = {"model": live.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert httpx.get(f"{probe_url}/health").status_code == 200
    assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=30).status_code == 200
    live.ffn_stop.set()  # the FFN rank stops (a deleted pod): it says goodbye on the way out
    live.ffn_thread.join(5)
    unready_after = _wait_for_status(f"{probe_url}/health", 503, timeout_s=5)
    assert unready_after is not None, "readiness still 200 five seconds after the FFN left"
    assert unready_after < 1.0, f"readiness took {unready_after:.2f} s to turn 503"
    print(f"in-process: readiness 503 {unready_after:.2f} s after the FFN stopped")
    assert "ffn rank 0" in httpx.get(f"{probe_url}/health").json()["reason"]
    # Alive the whole time: the kubelet must not restart a rank that waits to re-handshake.
    for _ in range(10):
        assert httpx.get(f"{probe_url}/live").status_code == 200
        time.sleep(0.05)


def test_liveness_fails_when_the_engine_thread_dies(live_with_probes, monkeypatch):
    live, probe_url, _ = live_with_probes
    assert httpx.get(f"{probe_url}/live").json() == {"status": "ok"}

    def die():
        raise SystemExit("simulated death of the engine thread")

    monkeypatch.setattr(live.engine.scheduler, "schedule", die)
    body = {"model": live.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=10).status_code == 503
    live.engine._thread.join(5)
    dead = httpx.get(f"{probe_url}/live")
    assert dead.status_code == 503 and "engine thread died" in dead.json()["reason"]


def test_liveness_fails_when_the_api_event_loop_stalls(live_with_probes, monkeypatch):
    live, probe_url, _ = live_with_probes
    monkeypatch.setattr(live.state.loop_watch, "problem", lambda: "the HTTP event loop has not run for 60 s (blocked or stopped)")
    stalled = httpx.get(f"{probe_url}/live")
    assert stalled.status_code == 503 and "event loop" in stalled.json()["reason"]


def test_the_prestop_drain_turns_readiness_503_and_the_server_keeps_serving(live_with_probes):
    live, probe_url, _ = live_with_probes
    body = {"model": live.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    answer: dict = {}
    hook = threading.Thread(target=lambda: answer.update(r=httpx.get(f"{probe_url}/drain?seconds=1.5", timeout=10)))
    started = time.monotonic()
    hook.start()  # what the kubelet does first when the pod is deleted
    assert _wait_for_status(f"{probe_url}/health", 503, timeout_s=0.5) is not None
    assert httpx.get(f"{probe_url}/health").json()["reason"].startswith("draining")
    assert hook.is_alive()  # the hook holds SIGTERM back for the drain's whole time...
    served = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30)
    assert served.status_code == 200  # ...while requests still routed here are served
    assert httpx.get(f"{probe_url}/live").status_code == 200
    hook.join(10)
    assert answer["r"].status_code == 200 and answer["r"].json()["status"] == "drained"
    assert 1.4 <= time.monotonic() - started < 5
    assert httpx.get(f"{probe_url}/health").status_code == 503  # and stays unready until the stop


def test_readiness_is_503_once_the_stop_is_signalled(live_with_probes):
    _, probe_url, stop = live_with_probes
    stop.set()  # SIGTERM
    assert httpx.get(f"{probe_url}/health").json()["reason"] == "shutting down"


def test_an_ffn_drain_ends_as_soon_as_its_attention_ranks_have_left():
    peers = {"attn-0": 0}
    server, url = _probe_server(Probes(lambda: None, drained=lambda: not peers))
    try:
        threading.Timer(0.3, peers.clear).start()  # the attention rank says goodbye
        started = time.monotonic()
        response = httpx.get(f"{url}/drain?seconds=30", timeout=10)
        assert response.status_code == 200 and 0.25 <= time.monotonic() - started < 2
    finally:
        server.shutdown()


@pytest.mark.parametrize("query, message", [
    ("", "needs ?seconds=N"), ("seconds=soon", "is not a number"), ("seconds=-1", "must be in 0..3600"),
])
def test_a_bad_drain_request_is_refused_with_the_reason(query, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        drain_seconds(query)
    server, url = _probe_server(Probes(lambda: None))
    try:
        response = httpx.get(f"{url}/drain?{query}")
        assert response.status_code == 400 and message in response.json()["error"]
        assert httpx.get(f"{url}/health").status_code == 200  # a refused drain changes nothing
    finally:
        server.shutdown()


# --- real processes: `afd serve` as the kubelet drives it ---------------------------------------

def _serve_group(checkpoint, tmp_path, marker):
    """One FFN and one attention `afd serve` process on 127.0.0.1; their URLs."""
    base = free_port_block(5)
    env = {**os.environ, "AFD_TEST_MARKER": marker, "AFD_MODEL": str(checkpoint), "AFD_BIND_HOST": "127.0.0.1",
           "AFD_CONTROL_PORT": str(base), "AFD_DATA_PORT": str(base + 1), "AFD_HTTP_HOST": "127.0.0.1",
           "OMP_NUM_THREADS": "1"}
    ffn = subprocess.Popen([sys.executable, "-m", "afd", "serve"], env={**env, "AFD_ROLE": "ffn", "AFD_METRICS_PORT": str(base + 2)},
                           stderr=open(tmp_path / "ffn.log", "w"))
    attention = subprocess.Popen([sys.executable, "-m", "afd", "serve"], stderr=open(tmp_path / "attention.log", "w"),
                                 env={**env, "AFD_ROLE": "attention", "AFD_HTTP_PORT": str(base + 3),
                                      "AFD_METRICS_PORT": str(base + 4)})
    urls = {"api": f"http://127.0.0.1:{base + 3}/v1", "probe": f"http://127.0.0.1:{base + 4}",
            "ffn_probe": f"http://127.0.0.1:{base + 2}"}
    return ffn, attention, urls


def _prestop_drain(probe_url: str, seconds: int, timeout_s: float, answers: dict, key: str) -> threading.Thread:
    """The kubelet's preStop hook, `GET /drain?seconds=N`, in its own thread; its answer lands in answers[key]."""
    thread = threading.Thread(target=lambda: answers.update(
        {key: httpx.get(f"{probe_url}/drain?seconds={seconds}", timeout=timeout_s)}))
    thread.start()
    return thread


def _ready(probe_url):
    try:
        return httpx.get(f"{probe_url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _stop_all(marker, *children):
    for child in children:
        if child.poll() is None:
            child.kill()
    assert wait_for(lambda: processes_with_marker(marker) == [] or None, 10, "no process left")


@pytest.mark.timeout(300)
def test_a_served_rank_is_unready_within_a_second_when_its_ffn_pod_stops(checkpoints, tmp_path):
    marker = uuid.uuid4().hex
    ffn, attention, urls = _serve_group(checkpoints["qwen3_moe"], tmp_path, marker)
    try:
        wait_for(lambda: _ready(urls["probe"]), 120, "the attention rank to be ready")
        ffn.send_signal(signal.SIGTERM)  # the FFN pod is deleted: it says goodbye and exits
        assert ffn.wait(timeout=15) == 0
        unready_after = _wait_for_status(f"{urls['probe']}/health", 503, timeout_s=5)
        assert unready_after is not None and unready_after < 1.0, unready_after
        print(f"afd serve: readiness 503 {unready_after:.2f} s after the FFN process exited")
        assert httpx.get(f"{urls['probe']}/live").status_code == 200
        assert attention.poll() is None  # waiting to re-handshake, not exiting
    finally:
        _stop_all(marker, attention, ffn)


def _start_in_flight_stream(urls: dict) -> tuple[str, threading.Thread, dict]:
    """Once the attention rank is ready, a 300-token stream in flight: (model, its thread, its results)."""
    wait_for(lambda: _ready(urls["probe"]), 120, "the attention rank to be ready")
    model = httpx.get(f"{urls['api']}/models").json()["data"][0]["id"]
    results: dict = {}
    worker = threading.Thread(target=stream, args=(urls["api"], model, 300, results, "in-flight"))
    worker.start()
    time.sleep(0.5)
    return model, worker, results


@pytest.mark.timeout(300)
def test_a_group_stopped_as_in_a_rollout_finishes_every_request(checkpoints, tmp_path):
    """The kubelet's order for every pod of the group at once: preStop /drain, then SIGTERM. The
    attention rank serves on while draining; the FFN's drain holds it up until its attention rank
    has said goodbye, so the in-flight stream ends normally."""
    marker = uuid.uuid4().hex
    ffn, attention, urls = _serve_group(checkpoints["qwen3_moe"], tmp_path, marker)
    try:
        model, worker, results = _start_in_flight_stream(urls)
        hooks: dict = {}
        ffn_hook = _prestop_drain(urls["ffn_probe"], 60, 90, hooks, "ffn")
        started = time.monotonic()
        attention_hook = _prestop_drain(urls["probe"], 1, 10, hooks, "attention")
        assert _wait_for_status(f"{urls['probe']}/health", 503, timeout_s=0.5) is not None
        late = httpx.post(f"{urls['api']}/completions", json={"model": model, "prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert late.status_code == 200  # a request a stale proxy still routes here is served
        attention_hook.join(10)
        attention.send_signal(signal.SIGTERM)  # the hook returned: the kubelet stops the container
        worker.join(60)
        assert attention.wait(timeout=40) == 0
        finish, tokens, error, _ = results["in-flight"]
        assert error is None and finish == "length" and tokens == 300
        ffn_hook.join(30)
        assert hooks["ffn"].status_code == 200  # ended by the goodbye, far before its 60 s
        print(f"ffn drain ended after {hooks['ffn'].json()['waited_s']} s (bound 60 s)")
        assert time.monotonic() - started < 45
        ffn.send_signal(signal.SIGTERM)
        assert ffn.wait(timeout=10) == 0
    finally:
        _stop_all(marker, attention, ffn)


def test_an_ffn_about_to_stop_makes_its_attention_rank_unready_while_it_still_serves(live_with_probes, monkeypatch):
    """wire.Draining: the FFN pod's preStop tells its attention ranks, which leave the Service
    at once but finish (and still serve) requests; the FFN's drain ends once they are quiet."""
    from afd.connector import ffn_link

    monkeypatch.setattr(ffn_link, "DRAIN_NOTICE_S", 0.5)
    live, probe_url, _ = live_with_probes
    body = {"model": live.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=30).status_code == 200
    assert not live.ffn.drained()
    live.ffn.request_drain()  # what the FFN pod's /drain does first
    unready_after = _wait_for_status(f"{probe_url}/health", 503, timeout_s=5)
    assert unready_after is not None and unready_after < 1.0, unready_after
    assert "ffn rank 0 is about to stop" in httpx.get(f"{probe_url}/health").json()["reason"]
    assert httpx.get(f"{probe_url}/live").status_code == 200
    assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=30).status_code == 200  # still served
    assert wait_for(lambda: live.ffn.drained() or None, 5, "the FFN drain to end once its peer is quiet")


def test_an_idle_attention_rank_leaves_a_draining_ffn_so_its_drain_ends_without_guessing(live_with_probes, monkeypatch):
    """Quiet time misjudges a starved CPU (a step gap of over a second mid-request): the attention
    rank itself says goodbye once it runs nothing, and the draining FFN does not take it back."""
    from afd.connector import ffn_link

    monkeypatch.setattr(ffn_link, "DRAIN_NOTICE_S", 600.0)  # only the goodbye can end this drain
    live, probe_url, _ = live_with_probes
    body = {"model": live.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=30).status_code == 200
    live.ffn.request_drain()
    started = time.monotonic()
    assert wait_for(lambda: live.ffn.drained() or None, 10, "the idle attention rank to leave the draining FFN")
    left_after = time.monotonic() - started
    assert 1.5 < left_after < 8, left_after  # it stayed for the notice (endpoint removal), then left
    assert not live.ffn.link.peers
    time.sleep(1.5)  # it keeps trying to re-handshake; the draining FFN refuses
    assert not live.ffn.link.peers
    assert httpx.get(f"{probe_url}/health").status_code == 503
    assert httpx.get(f"{probe_url}/live").status_code == 200
    print(f"the idle attention rank left the draining FFN after {left_after:.1f} s")


@pytest.mark.timeout(300)
def test_an_ffn_pod_deleted_alone_lets_its_attention_rank_finish_first(checkpoints, tmp_path):
    """The kubelet deletes only the FFN pod: its preStop /drain turns the attention rank unready
    within a second, the in-flight stream still finishes, and only then does the FFN stop."""
    marker = uuid.uuid4().hex
    ffn, attention, urls = _serve_group(checkpoints["qwen3_moe"], tmp_path, marker)
    try:
        model, worker, results = _start_in_flight_stream(urls)
        hook: dict = {}
        drain = _prestop_drain(urls["ffn_probe"], 60, 90, hook, "r")
        unready_after = _wait_for_status(f"{urls['probe']}/health", 503, timeout_s=5)
        assert unready_after is not None and unready_after < 1.0, unready_after
        print(f"attention unready {unready_after:.2f} s after the FFN pod's drain began")
        assert httpx.get(f"{urls['probe']}/live").status_code == 200
        worker.join(60)
        finish, tokens, error, _ = results["in-flight"]
        assert error is None and finish == "length" and tokens == 300
        drain.join(60)
        assert hook["r"].status_code == 200 and hook["r"].json()["waited_s"] < 30
        print(f"ffn drain ended after {hook['r'].json()['waited_s']} s (stream done, peer quiet)")
        ffn.send_signal(signal.SIGTERM)
        assert ffn.wait(timeout=15) == 0
        assert attention.poll() is None and httpx.get(f"{urls['probe']}/live").status_code == 200
    finally:
        _stop_all(marker, attention, ffn)
