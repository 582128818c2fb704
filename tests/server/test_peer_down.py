"""When the FFN peer goes away, requests end with 503 (never a hang, never a short answer)."""

import time

import httpx

from tests.server.conftest import LiveServer


def test_ffn_loss_fails_requests_with_503_and_health_turns_503(checkpoints):
    live = LiveServer(checkpoints["deepseek_v2"])
    try:
        body = {"model": live.model, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=30).status_code == 200
        live.ffn_stop.set()  # the FFN rank shuts down and says goodbye
        live.ffn_thread.join(5)
        started = time.monotonic()
        failed = httpx.post(f"{live.url}/v1/completions", json={**body, "max_tokens": 50}, timeout=30)
        assert failed.status_code == 503 and "ffn rank 0" in failed.json()["error"]["message"]
        assert time.monotonic() - started < 10
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503 and health.json()["reason"]
        again = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30)
        assert again.status_code == 503
    finally:
        live.close()
