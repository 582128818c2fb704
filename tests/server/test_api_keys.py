"""API keys (`api_key`, issue 52): every `/v1` route and `/tokenize` / `/detokenize` answer 401 in OpenAI's error
format without one of the keys, and as before with any of them; `/health`, `/live` and `/metrics` stay open; the
rank's API processes and `afd up`'s front door check the same way; no key in a log, a repr or an error."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from afd.config import SETTINGS, AFDConfig, ConfigError, config_to_env, load_config
from afd.server.api.api_keys import ApiKeys, bearer
from afd.server.front.door import Backends, FrontSettings, create_front_app
from tests.server.conftest import _free_port
from tests.server.test_up import wait_for

KEYS = ("sk-first-3f9a1c", "sk-second-77d2e0")
WRONG = ("", "Bearer", "Bearer sk-wrong", f"Bearer {KEYS[0]}x", f"Bearer {KEYS[0][:-1]}", f"Basic {KEYS[0]}",
         KEYS[0], f"Bearer {KEYS[0]},{KEYS[1]}")


def test_a_key_is_allowed_only_as_a_bearer_token_of_a_configured_key():
    keys = ApiKeys(KEYS)
    assert all(keys.allows(f"Bearer {key}") for key in KEYS)
    assert keys.allows(f"bearer {KEYS[1]}")  # the scheme is case-insensitive (RFC 7235)
    assert not any(keys.allows(header) for header in (*WRONG, None))
    assert ApiKeys().allows(None) and not ApiKeys()  # none configured: every request passes
    assert KEYS[0] not in repr(keys)


def test_the_setting_takes_several_keys_and_never_shows_them():
    config = load_config(env={"AFD_API_KEY": f" {KEYS[0]} ,{KEYS[1]}"})
    assert config.api_keys == KEYS
    assert AFDConfig().api_keys == ()
    assert not any(key in repr(config) for key in KEYS)
    assert config_to_env(config)["AFD_API_KEY"] == config.api_key  # the API processes get it
    assert SETTINGS["api_key"].secret and SETTINGS["api_key"].flag_name == "--api-key"
    for bad in (f"{KEYS[0]},", f"{KEYS[0]},,{KEYS[1]}", "sk one", "sk-clé"):
        with pytest.raises(ConfigError) as refused:
            load_config(env={"AFD_API_KEY": bad})
        assert "sk" not in str(refused.value) and "api_key=(secret)" in str(refused.value)


def test_the_vllm_engine_gets_its_one_key_in_its_environment():
    from afd.vllm_plugin.serve import engine_env

    assert engine_env({}, KEYS[:1])["VLLM_API_KEY"] == KEYS[0]
    assert "VLLM_API_KEY" not in engine_env({})
    with pytest.raises(ConfigError):
        engine_env({}, KEYS)


def _door(api_keys: ApiKeys, urls=()) -> object:
    return create_front_app(Backends(lambda: list(urls)), FrontSettings(api_keys=api_keys))


async def _ask(app, method: str, path: str, headers=None, base_url="http://door") -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url) as client:
        return await client.request(method, path, headers=headers or {}, json={})


def _refused(response: httpx.Response) -> bool:
    error = response.json()["error"]
    return (response.status_code == 401 and error["code"] == 401 and error["type"] == "invalid_request_error"
            and "API key" in error["message"] and response.headers["www-authenticate"] == "Bearer")


ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("POST", "/tokenize"), ("POST", "/detokenize")]


def test_the_front_door_refuses_every_api_route_without_a_key_and_leaves_its_probes_open():
    door = _door(ApiKeys(KEYS))
    for method, path in ROUTES + [("GET", "/v1/anything")]:
        for header in WRONG:
            assert _refused(asyncio.run(_ask(door, method, path, {"Authorization": header} if header else None)))
        for key in KEYS:  # past the check: no rank to relay to
            assert asyncio.run(_ask(door, method, path, bearer((key,)))).status_code == 503
    assert asyncio.run(_ask(door, "GET", "/health")).status_code == 503  # open: no rank is the answer
    assert asyncio.run(_ask(door, "GET", "/metrics")).status_code == 200
    assert asyncio.run(_ask(_door(ApiKeys()), "GET", "/v1/models")).status_code == 503  # no key configured


class KeyedServe:
    """`afd serve` (monolithic, tiny Qwen3-MoE) with two API keys; its log in a file."""

    def __init__(self, checkpoint: Path, log: Path, servers: int):
        self.api, self.metrics = _free_port(), _free_port()
        env = {**os.environ, "AFD_API_KEY": ",".join(KEYS), "AFD_API_SERVERS": str(servers), "AFD_LOG_LEVEL": "DEBUG",
               "AFD_HTTP_HOST": "127.0.0.1", "AFD_HTTP_PORT": str(self.api), "AFD_METRICS_PORT": str(self.metrics),
               "AFD_DEVICE": "cpu", "AFD_KV_CACHE_BYTES": str(64 << 20), "AFD_SHUTDOWN_GRACE_S": "10"}
        self.log = log.open("wb")
        self.process = subprocess.Popen([sys.executable, "-m", "afd", "serve", "--role", "monolithic", "--model",
                                         str(checkpoint)], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.api}"
        wait_for(self._ready, 180, "afd serve to be ready")

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            pytest.fail(f"afd serve exited with {self.process.returncode} while starting")
        try:
            return httpx.get(f"http://127.0.0.1:{self.metrics}/health", timeout=2).status_code == 200 and \
                httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)
        self.log.close()


def _bodies(model: str) -> dict[str, dict]:
    return {"/v1/models": {}, "/v1/completions": {"model": model, "prompt": "Hello", "max_tokens": 2},
            "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            "/tokenize": {"model": model, "prompt": "Hello"}, "/detokenize": {"model": model, "tokens": [1, 2]}}


@pytest.mark.parametrize("servers", [1, 2], ids=["in-process", "two-api-processes"])
def test_a_served_rank_asks_every_api_route_for_a_key(checkpoints, tmp_path, servers):
    served = KeyedServe(checkpoints["qwen3_moe"], tmp_path / "serve.log", servers)
    try:
        model = httpx.get(f"{served.url}/v1/models", headers=bearer(KEYS)).json()["data"][0]["id"]
        for (method, path), body in zip(ROUTES, _bodies(model).values()):
            send = lambda **extra: httpx.request(method, served.url + path, json=body or None, timeout=60, **extra)  # noqa: E731
            for header in WRONG:
                assert _refused(send(headers={"Authorization": header} if header else {})), (path, header)
            for key in KEYS:
                assert send(headers=bearer((key,))).status_code == 200, (path, key)
        for probe in (f"{served.url}/health", f"{served.url}/metrics", f"http://127.0.0.1:{served.metrics}/health",
                      f"http://127.0.0.1:{served.metrics}/live", f"http://127.0.0.1:{served.metrics}/metrics"):
            assert httpx.get(probe).status_code == 200, probe
        door = _door(ApiKeys(KEYS), [served.url])  # the front door forwards the client's key to the rank
        assert asyncio.run(_ask(door, "GET", "/v1/models", bearer(KEYS[1:]))).status_code == 200
        assert _refused(asyncio.run(_ask(door, "GET", "/v1/models")))
    finally:
        served.stop()
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert "serving on" in log and not any(key in log for key in KEYS)


def test_benches_send_the_key_of_their_environment(monkeypatch):
    from afd.server.api.api_keys import env_bearer

    monkeypatch.setenv("AFD_API_KEY", ",".join(KEYS))
    assert env_bearer() == {"Authorization": f"Bearer {KEYS[0]}"}
    monkeypatch.delenv("AFD_API_KEY")
    assert env_bearer() == {}
