"""Clients of a running group's OpenAI API, and a local group to run them against: one streamed completion
timed token by token, a load-test client that counts failures, and `afd up` for the length of a block."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from afd.server.api.api_keys import env_bearer


async def one_request(client, api, model, prompt, max_tokens, ttfts, itls, extra: dict | None = None) -> int:
    """Tokens of one streamed completion (TTFT and gaps appended); `extra`: more request fields (penalties)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            **(extra or {})}
    started, last, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", f"{api}/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if json.loads(line[6:]).get("choices"):
                if last is None:
                    ttfts.append(now - started)
                else:
                    itls.append(now - last)
                last, tokens = now, tokens + 1
    return tokens


async def client_loop(client, api, model, deadline, latencies, failures, counter):
    index = 0
    while time.monotonic() < deadline:
        index += 1
        body = {"model": model, "prompt": f"Load test request {index}", "max_tokens": 16 + index % 17, "stream": True}
        started = time.monotonic()
        try:
            async with client.stream("POST", f"{api}/completions", json=body) as response:
                if response.status_code != 200:
                    failures.append(f"HTTP {response.status_code}")
                    continue
                finished = False
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            failures.append(chunk["error"]["message"])
                            break
                        counter[0] += len(chunk["choices"])
                        finished = finished or any(c["finish_reason"] for c in chunk["choices"])
                if not finished:
                    failures.append("stream ended without a finish reason")
        except httpx.HTTPError as err:
            failures.append(f"{type(err).__name__}: {err}")
            continue
        latencies.append(time.monotonic() - started)


@contextlib.contextmanager
def running_up(topology: str, port: int, log: str | None = None):
    """`afd up` of `topology` on `port` until the block ends; yields (its state file's content, the model id)."""
    state_file = Path(tempfile.mkdtemp()) / "state.json"
    stderr = open(log, "w") if log else subprocess.DEVNULL
    up = subprocess.Popen([sys.executable, "-m", "afd", "up", "--topology", topology, "--port", str(port),
                           "--state-file", str(state_file), "--no-demo"], stderr=stderr)
    try:
        while not state_file.exists():
            if up.poll() is not None:
                raise SystemExit("afd up did not start")
            time.sleep(0.5)
        state = json.loads(state_file.read_text())
        yield state, httpx.get(f"{state['api']}/models", headers=env_bearer()).json()["data"][0]["id"]
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
