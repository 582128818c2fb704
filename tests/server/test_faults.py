"""Fault tests on real processes: SIGTERM drains, kill -9 of an FFN or attention rank under load."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from afd.local.children import free_port_block
from tests.runtime.test_generate_cli import processes_with_marker
from tests.server.test_up import read_state, wait_for


def stream(url, model, max_tokens, results, key):
    """One streaming completion; records (finish_reason, tokens, error, seconds from the first chunk to the end)."""
    body = {"model": model, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    tokens, finish, error, first = 0, None, None, None
    try:
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                first = first or time.monotonic()
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    break
                for choice in chunk["choices"]:
                    tokens += 1
                    finish = choice["finish_reason"] or finish
    except httpx.HTTPError as err:
        error = f"{type(err).__name__}: {err}"
    results[key] = (finish, tokens, error, time.monotonic())


@pytest.mark.timeout(300)
def test_sigterm_lets_in_flight_streams_finish(checkpoints, tmp_path):
    marker = uuid.uuid4().hex
    base = free_port_block(4)
    env = {**os.environ, "AFD_TEST_MARKER": marker, "AFD_MODEL": str(checkpoints["qwen3_moe"]), "AFD_BIND_HOST": "127.0.0.1",
           "AFD_CONTROL_PORT": str(base), "AFD_DATA_PORT": str(base + 1), "AFD_HTTP_HOST": "127.0.0.1",
           "OMP_NUM_THREADS": "1"}
    ffn = subprocess.Popen([sys.executable, "-m", "afd", "serve"], env={**env, "AFD_ROLE": "ffn", "AFD_METRICS_PORT": str(base + 2)},
                           stderr=open(tmp_path / "ffn.log", "w"))
    attention = subprocess.Popen([sys.executable, "-m", "afd", "serve"],
                                 env={**env, "AFD_ROLE": "attention", "AFD_HTTP_PORT": str(base + 3),
                                      "AFD_METRICS_PORT": str(free_port_block(1))},
                                 stderr=open(tmp_path / "attention.log", "w"))
    url = f"http://127.0.0.1:{base + 3}/v1"
    try:
        wait_for(lambda: _healthy(url), 120, "the attention rank")
        model = httpx.get(f"{url}/models").json()["data"][0]["id"]
        results = {}
        worker = threading.Thread(target=stream, args=(url, model, 400, results, "s"))
        worker.start()
        time.sleep(1.0)
        attention.send_signal(signal.SIGTERM)
        worker.join(60)
        assert attention.wait(timeout=40) == 0
        finish, tokens, error, _ = results["s"]
        assert error is None and finish == "length" and tokens == 400  # the stream finished in the grace period
        assert "attention peer attn-0 left" in (tmp_path / "ffn.log").read_text()
        ffn.send_signal(signal.SIGTERM)
        assert ffn.wait(timeout=10) == 0
    finally:
        for child in (attention, ffn):
            if child.poll() is None:
                child.kill()
    assert wait_for(lambda: processes_with_marker(marker) == [] or None, 10, "no process left")


def _healthy(api):
    try:
        return httpx.get(api.removesuffix("/v1") + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class HealthWatch(threading.Thread):
    """Polls an API's /health every 0.1 s until stopped: (time, status code, body) each time it answered."""

    def __init__(self, api):
        super().__init__(daemon=True)
        self.url, self.seen, self.done = api.removesuffix("/v1") + "/health", [], threading.Event()

    def run(self):
        while not self.done.wait(0.1):
            try:
                reply = httpx.get(self.url, timeout=1)
                self.seen.append((time.monotonic(), reply.status_code, reply.json()))
            except (httpx.HTTPError, ValueError):
                pass

    def stop(self):
        self.done.set()
        self.join(5)


@pytest.mark.timeout(400)
def test_kill_ffn_and_attention_ranks_under_load(tmp_path):
    marker = uuid.uuid4().hex
    port = free_port_block(1)
    state_file = tmp_path / "state.json"
    env = {**os.environ, "AFD_TEST_MARKER": marker, "AFD_CACHE_DIR": str(tmp_path / "cache"),
           "AFD_FFN_HOLD_S": "0"}  # requests fail at once when their FFN dies (test_rank_loss.py: they are held)
    up = subprocess.Popen([sys.executable, "-m", "afd", "up", "--topology", "2A2F", "--port", str(port),
                           "--state-file", str(state_file), "--no-demo"], env=env, stdout=subprocess.DEVNULL,
                          stderr=open(tmp_path / "up.log", "w"))
    try:
        state = wait_for(lambda: read_state(state_file), 240, "the state file")
        rank = {(r["role"], r["rank"]): r for r in state["ranks"]}
        api0, api1 = rank[("attention", 0)]["api"], rank[("attention", 1)]["api"]
        model = httpx.get(f"{api0}/models").json()["data"][0]["id"]

        # kill -9 FFN rank 1 while attention rank 1 streams (under load) and attention rank 0 streams too
        results = {}
        workers = [threading.Thread(target=stream, args=(api, model, 3000, results, f"{name}{i}"))
                   for i in range(4) for name, api in (("a0-", api0), ("a1-", api1))]
        for worker in workers:
            worker.start()
        health1 = HealthWatch(api1)
        health1.start()
        time.sleep(2.0)
        killed_at = time.monotonic()
        os.kill(rank[("ffn", 1)]["pid"], signal.SIGKILL)
        for worker in workers:
            worker.join(90)
        cut = [results[f"a1-{i}"] for i in range(4)]
        assert all(error and finish is None for finish, _, error, _ in cut), cut  # explicit errors, not short answers
        failed_within = max(end for *_, end in cut) - killed_at
        assert failed_within < 10, failed_within
        assert all(results[f"a0-{i}"][:3] == ("length", 3000, None) for i in range(4))  # the other pair kept serving

        # the supervisor restarts FFN rank 1; attention rank 1 re-handshakes without a restart
        wait_for(lambda: _healthy(api1) and (s := read_state(state_file)) and
                 next(r["pid"] for r in s["ranks"] if r["role"] == "ffn" and r["rank"] == 1) != rank[("ffn", 1)]["pid"],
                 120, "FFN rank 1 back and attention rank 1 healthy")
        recovered_in = time.monotonic() - killed_at
        health1.stop()
        # /health of attention rank 1: ok before the kill, then "unavailable" with the reason while its FFN rank was
        # down (the restart loads the model: seconds, many polls), ok again once it re-handshook
        before = [code for at, code, _ in health1.seen if at < killed_at]
        down = [body for at, code, body in health1.seen if at > killed_at and code == 503]
        assert before and set(before) == {200}, health1.seen
        assert down and all(body["status"] == "unavailable" and body["reason"] for body in down), health1.seen
        assert health1.seen[-1][1] == 200, health1.seen[-1]
        now = read_state(state_file)
        assert next(r["pid"] for r in now["ranks"] if r["role"] == "attention" and r["rank"] == 1) == rank[("attention", 1)]["pid"]
        after = httpx.post(f"{api1}/completions", json={"model": model, "prompt": "Hi", "max_tokens": 5}, timeout=30)
        assert after.status_code == 200

        # kill -9 attention rank 0: FFN rank 0 drops it; attention rank 1 (FFN rank 1) is untouched
        survivors = {}
        worker = threading.Thread(target=stream, args=(api1, model, 1500, survivors, "s"))
        worker.start()
        time.sleep(0.5)
        os.kill(rank[("attention", 0)]["pid"], signal.SIGKILL)
        worker.join(60)
        assert survivors["s"][:3] == ("length", 1500, None)
        print(f"\nfault timings: in-flight requests failed {failed_within:.2f} s after kill -9 of ffn-1 "
              f"(/health of attention-1 503 in {len(down)} polls); "
              f"ffn-1 restarted and attention-1 healthy again {recovered_in:.1f} s after the kill")
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert wait_for(lambda: processes_with_marker(marker) == [] or None, 15, "every process to stop")
