"""`afd up`: a supervised local deployment behind one URL, restarts, state file, clean stop."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from tests.runtime.test_generate_cli import processes_with_marker


def wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def answers_200(url: str) -> bool:
    """True once `url` answers 200; a server still starting refuses connections meanwhile."""
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def read_state(path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


@pytest.mark.timeout(400)
def test_afd_up_serves_restarts_and_stops(tmp_path):
    import openai

    from afd.local.children import free_port_block

    marker = uuid.uuid4().hex
    port = free_port_block(1)
    state_file = tmp_path / "state.json"
    env = {**os.environ, "AFD_TEST_MARKER": marker, "AFD_CACHE_DIR": str(tmp_path / "cache")}
    up = subprocess.Popen([sys.executable, "-m", "afd", "up", "--port", str(port), "--state-file", str(state_file), "--no-demo"],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        state = wait_for(lambda: read_state(state_file), 240, "the state file")
        assert state["api"] == f"http://127.0.0.1:{port}/v1"
        roles = sorted((r["role"], r["rank"]) for r in state["ranks"])
        assert roles == [("attention", 0), ("attention", 1), ("ffn", 0)]
        ffn = next(r for r in state["ranks"] if r["role"] == "ffn")
        assert ffn["control"].startswith("tcp://127.0.0.1:") and ffn["data"].startswith("tcp://127.0.0.1:")
        wait_for(lambda: answers_200(f"http://127.0.0.1:{port}/health"), 30, "the front door")
        client = openai.OpenAI(base_url=state["api"], api_key="unused")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
        assert reply.usage.completion_tokens >= 1
        for rank in state["ranks"]:
            assert "afd_" in httpx.get(rank["metrics"]).text  # every rank serves Prometheus metrics

        victim = next(r for r in state["ranks"] if r["role"] == "attention" and r["rank"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        restarted = wait_for(
            lambda: (s := read_state(state_file)) and next(r["pid"] for r in s["ranks"] if r["role"] == "attention" and r["rank"] == 1) != victim["pid"] and s,
            120, "attention rank 1 to be restarted")
        assert next(r["pid"] for r in restarted["ranks"] if r["role"] == "ffn") == ffn["pid"]  # others untouched
        for _ in range(4):  # both ranks answer again through the one URL
            assert client.completions.create(model=model, prompt="Hello", max_tokens=3).usage.completion_tokens >= 1
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=30)
    stderr = up.stderr.read()
    assert up.returncode == 0, stderr
    # the restarted rank too: it was started by the supervisor's thread, which must outlive its stop
    assert_every_rank_exited_0(stderr, ["attention-0", "attention-1", "ffn-0"])
    assert wait_for(lambda: processes_with_marker(marker) == [] or None, 15, "every process to stop") is not None


def assert_every_rank_exited_0(stderr: str, names: list[str]) -> None:
    stopped = [line for line in stderr.splitlines() if "stopped every rank" in line]
    assert stopped, stderr[-2000:]
    assert all(f"{name} exit 0" in stopped[-1] for name in names), stopped[-1]


@pytest.mark.timeout(400)
def test_ctrl_c_is_a_planned_stop_every_rank_exits_0_and_logs_no_error(tmp_path):
    """Issue 35.8: a terminal's Ctrl-C (SIGINT to the whole process group) stops every rank in order
    (attention ranks first, so none sees its FFN rank vanish): each exits 0, no log has an ERROR line."""
    from afd.local.children import free_port_block

    marker = uuid.uuid4().hex
    port = free_port_block(1)
    state_file = tmp_path / "state.json"
    env = {**os.environ, "AFD_TEST_MARKER": marker, "AFD_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmp_path)}
    up = subprocess.Popen([sys.executable, "-m", "afd", "up", "--port", str(port), "--state-file", str(state_file), "--no-demo"],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        state = wait_for(lambda: read_state(state_file), 240, "the state file")
        body = {"model": httpx.get(f"{state['api']}/models", timeout=10).json()["data"][0]["id"], "prompt": "Hi", "max_tokens": 3}
        assert httpx.post(f"{state['api']}/completions", json=body, timeout=60).status_code == 200
        os.killpg(up.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        up.wait(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
    stderr = up.stderr.read()
    assert up.returncode == 0, stderr
    assert_every_rank_exited_0(stderr, ["attention-0", "attention-1", "ffn-0"])
    logs = sorted(tmp_path.glob("afd-local-*/*.log"))
    assert [path.name for path in logs] == ["attention-0.log", "attention-1.log", "ffn-0.log"]
    errors = [line for path in logs for line in path.read_text().splitlines() if " ERROR " in line or " CRITICAL " in line]
    assert errors == []
    assert wait_for(lambda: processes_with_marker(marker) == [] or None, 15, "every process to stop") is not None
