"""An attention rank survives its FFN rank: requests fail fast, then it re-handshakes and serves again."""

import threading
import time

import httpx

from afd.roles.ffn import build_ffn
from tests.server.conftest import LiveServer


def wait_until(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_ffn_restart_is_recovered_without_restarting_attention(checkpoints):
    live = LiveServer(checkpoints["qwen3_moe"])
    try:
        body = {"model": live.model, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        before = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
        live.ffn_stop.set()
        live.ffn_thread.join(5)
        assert wait_until(lambda: httpx.get(f"{live.url}/health").status_code == 503, 10)
        assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=30).status_code == 503

        ffn = build_ffn(live.config.replace(role="ffn"))  # the FFN rank comes back at the same address
        stop = threading.Event()
        thread = threading.Thread(target=ffn.serve, args=(stop,), daemon=True)
        thread.start()
        try:
            started = time.monotonic()
            assert wait_until(lambda: httpx.get(f"{live.url}/health").status_code == 200, 15)
            recovered_in = time.monotonic() - started
            after = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30)
            assert after.status_code == 200 and after.json()["choices"][0]["text"] == before
            assert recovered_in < 10
        finally:
            stop.set()
            thread.join(5)
    finally:
        live.close()


def test_idle_attention_notices_a_silent_ffn_through_heartbeats(checkpoints):
    live = LiveServer(checkpoints["qwen3_moe"])
    try:
        live.ffn.link.send_control = lambda *a, **k: True  # it says nothing on the way out
        live.ffn_stop.set()  # and its loop stops: it stops answering
        live.ffn_thread.join(5)
        started = time.monotonic()
        assert wait_until(lambda: httpx.get(f"{live.url}/health").status_code == 503, 15)
        assert time.monotonic() - started < live.config.peer_timeout_s + 3
        assert "heartbeat" in httpx.get(f"{live.url}/health").json()["reason"]
    finally:
        live.close()
