"""An exception in a step fails that step's requests only; a dead engine thread turns /health 503."""

import time

import httpx
import pytest

import afd.engine.engine as engine_module
from afd.server.probe_http import start_probe_server

BODY = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def complete(server, timeout=30, **body):
    return httpx.post(f"{server.url}/v1/completions", json={"model": server.model, **BODY, **body}, timeout=timeout)


def test_a_failing_sampler_fails_its_request_and_the_engine_serves_on(server, monkeypatch):
    before = complete(server).json()["choices"][0]["text"]
    real = engine_module.sample
    calls = []

    def broken_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(*args)

    monkeypatch.setattr(engine_module, "sample", broken_once)
    failed = complete(server)
    assert failed.status_code == 503 and "sampling failed" in failed.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert complete(server).json()["choices"][0]["text"] == before
    assert server.engine.num_running == 0 and server.engine.kv_cache.usage == 0
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'afd_request_errors_total{rank="0",role="attention"} 1.0' in metrics


def test_a_dead_engine_thread_turns_health_and_probe_503(server, monkeypatch):
    probe = start_probe_server("127.0.0.1", 0, server.state.problem, server.state.registry)
    probe_url = f"http://127.0.0.1:{probe.server_address[1]}/health"
    try:
        assert httpx.get(probe_url).status_code == 200

        def die():
            raise SystemExit("simulated death of the engine thread")

        monkeypatch.setattr(server.engine.scheduler, "schedule", die)
        started = time.monotonic()
        answer = complete(server, timeout=10)  # fails, never hangs
        assert answer.status_code == 503 and time.monotonic() - started < 10
        server.engine._thread.join(5)
        assert not server.engine._thread.is_alive() and "died" in server.engine.problem
        for url in (f"{server.url}/health", probe_url):
            health = httpx.get(url)
            assert health.status_code == 503 and "engine thread died" in health.json()["reason"]
        assert complete(server, timeout=10).status_code == 503  # refused at once, not queued forever
    finally:
        probe.shutdown()


@pytest.fixture(scope="module")
def server(checkpoints):
    from tests.server.conftest import LiveServer

    live = LiveServer(checkpoints["qwen3_moe"], stages=1)
    yield live
    live.close()
