"""AFD_API_PROCESS=1: `afd serve` with its HTTP API in a child process answers as the one-process server does."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import _free_port
from tests.server.test_up import wait_for

PROMPTS = ["The keys and values of every sequence", "Experts of the feed-forward layers", "Hello"]


class Served:
    """A monolithic `afd serve` on the tiny Qwen3-MoE checkpoint, on free ports."""

    def __init__(self, checkpoint: Path, api_process: bool, servers: int = 1, extra_env: dict | None = None):
        self.api, self.metrics = _free_port(), _free_port()
        env = {**os.environ, **(extra_env or {}), "AFD_API_PROCESS": "1" if api_process else "0",
               "AFD_API_SERVERS": str(servers),
               "AFD_HTTP_HOST": "127.0.0.1",
               "AFD_HTTP_PORT": str(self.api), "AFD_METRICS_PORT": str(self.metrics), "AFD_DEVICE": "cpu",
               "AFD_KV_CACHE_BYTES": str(64 << 20), "AFD_SHUTDOWN_GRACE_S": "10"}
        self.process = subprocess.Popen([sys.executable, "-m", "afd", "serve", "--role", "monolithic", "--model",
                                         str(checkpoint)], env=env, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.api}"
        wait_for(self._ready, 180, "afd serve to be ready")
        self.model = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            pytest.fail(f"afd serve exited with {self.process.returncode} while starting")
        try:
            return httpx.get(f"http://127.0.0.1:{self.metrics}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def children(self) -> list[int]:
        tasks = Path(f"/proc/{self.process.pid}/task")
        return [int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()]

    def metric(self, name: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    def complete(self, prompt: str, **extra) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **extra}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=60).json()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def servers(checkpoints):
    one, split = Served(checkpoints["qwen3_moe"], False), None
    try:
        split = Served(checkpoints["qwen3_moe"], True)
        yield one, split
    finally:
        for served in (one, split):
            if served is not None and served.process.poll() is None:
                served.process.kill()


def test_the_api_runs_in_a_child_process_only_when_asked(servers):
    one, split = servers
    assert one.children() == []
    [child] = split.children()
    assert "afd.server.api_process" in Path(f"/proc/{child}/cmdline").read_text()


def test_greedy_completions_and_chat_equal_the_one_process_server(servers):
    one, split = servers
    for prompt in PROMPTS:
        expected, got = one.complete(prompt, logprobs=1), split.complete(prompt, logprobs=1)
        assert got["choices"][0]["text"] == expected["choices"][0]["text"]
        assert got["choices"][0]["logprobs"]["tokens"] == expected["choices"][0]["logprobs"]["tokens"]
        counts = {k: got["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        assert counts == {"prompt_tokens": expected["usage"]["prompt_tokens"], "completion_tokens": 10,
                          "total_tokens": expected["usage"]["prompt_tokens"] + 10}
        assert expected["usage"] == {**counts, "prompt_tokens_details": expected["usage"]["prompt_tokens_details"]}
    chat = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 6, "temperature": 0}
    answers = [httpx.post(f"{s.url}/v1/chat/completions", json={"model": s.model, **chat}, timeout=60).json()
               for s in servers]
    assert answers[1]["choices"][0]["message"] == answers[0]["choices"][0]["message"]


def test_stop_strings_end_requests_as_in_one_process(servers):
    one, split = servers
    text = one.complete(PROMPTS[2], max_tokens=16)["choices"][0]["text"]  # the tiny model's text is noise
    stop = text[1:3]
    expected = one.complete(PROMPTS[2], max_tokens=16, stop=[stop])["choices"][0]
    got = split.complete(PROMPTS[2], max_tokens=16, stop=[stop])["choices"][0]
    assert (got["text"], got["finish_reason"]) == (expected["text"], expected["finish_reason"]) == (text[:text.index(stop)], "stop")
    body = {"model": split.model, "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stream": True, "stop": [stop]}
    with httpx.stream("POST", f"{split.url}/v1/completions", json=body, timeout=60) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"
    wait_for(lambda: split.metric("afd_requests_running") == 0, 10, "the core to drop the stopped request")


def test_a_stream_carries_the_same_text_and_ends_with_done(servers):
    _, split = servers
    body = {"model": split.model, "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{split.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == split.complete(PROMPTS[0])["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_n_choices_with_echo_logprobs_streamed_from_the_api_process_equal_the_one_process_server(servers):
    def streamed(served) -> tuple[list, dict]:
        body = {"model": served.model, "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 1.0, "seed": 9, "n": 2,
                "ignore_eos": True, "echo": True, "logprobs": 1, "stream": True,
                "stream_options": {"include_usage": True}}
        text = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).text
        chunks = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
        by_index = [[c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == i] for i in range(2)]
        return [("".join(p["text"] for p in parts), [t for p in parts for t in p["logprobs"]["tokens"]])
                for parts in by_index], chunks[-1]["usage"]

    one, split = servers
    expected, got = streamed(one), streamed(split)
    assert got == expected and len(got[0][0][1]) == 4 + 4 and got[1]["completion_tokens"] == 8


def test_a_client_that_leaves_mid_stream_frees_its_sequence_in_the_core(servers):
    _, split = servers
    body = {"model": split.model, "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    generated = split.metric("afd_generation_tokens_total")
    with httpx.stream("POST", f"{split.url}/v1/completions", json=body, timeout=60) as response:
        lines = (line for line in response.iter_lines() if line)
        for _ in range(3):
            assert next(lines).startswith("data: {")
        assert split.metric("afd_requests_running") == 1
    wait_for(lambda: split.metric("afd_requests_running") == 0, 10, "the core to abort the request")
    assert split.metric("afd_generation_tokens_total") - generated < 400  # it did not run to the end


def test_health_and_metrics_come_from_the_core(servers):
    _, split = servers
    split.complete(PROMPTS[2])
    assert httpx.get(f"{split.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"http://127.0.0.1:{split.metrics}/health").json() == {"status": "ok"}
    assert httpx.get(f"http://127.0.0.1:{split.metrics}/live").status_code == 200
    assert split.metric("afd_generation_tokens_total") >= 10
    assert split.metric("afd_time_to_first_token_seconds_count") >= 1
    api_metrics = httpx.get(f"{split.url}/metrics").text  # the API port shows the core's series too
    assert 'afd_kv_cache_capacity_tokens{rank="0",role="monolithic"}' in api_metrics


@pytest.mark.parametrize("body, status", [
    ({"prompt": "x", "max_tokens": -1}, 400),
    ({"prompt": "x", "temperature": -2}, 400),
    ({"prompt": ""}, 400),
    ({"prompt": "x", "max_tokens": 10**6}, 400),  # more than the context: the admission check
    ({"model": "nope", "prompt": "x"}, 404),
    ({"messages": "not a list"}, 400),
])
def test_a_bad_request_gets_the_same_error_body(servers, body, status):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    answers = [httpx.post(f"{s.url}{path}", json={"model": s.model, **body}, timeout=30) for s in servers]
    assert [a.status_code for a in answers] == [status, status]
    assert answers[1].json() == answers[0].json()
    garbled = [httpx.post(f"{s.url}/v1/completions", content=b"{not json", timeout=30) for s in servers]
    assert garbled[1].status_code == garbled[0].status_code == 400
    assert garbled[1].json() == garbled[0].json()


def _health(served) -> int | None:
    try:
        return httpx.get(f"{served.url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return None  # nobody listens on the port between the processes


@contextlib.contextmanager
def _streaming(served, max_tokens: int):
    """A streamed greedy completion of `max_tokens` tokens whose first event came: yields its later non-empty lines."""
    body = {"model": served.model, "prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as response:
        lines = (line for line in response.iter_lines() if line)
        assert next(lines).startswith("data: {")
        yield lines


def test_sigterm_finishes_in_flight_streams_exits_zero_and_takes_the_child(checkpoints):
    served = Served(checkpoints["qwen3_moe"], True)
    [child] = served.children()
    with _streaming(served, 60) as lines:
        served.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and len(rest) == 60  # 59 more tokens, then [DONE]
    assert served.stop() == 0
    assert not Path(f"/proc/{child}").exists()


def test_a_silent_core_fails_streams_and_health_and_a_dead_api_process_is_started_again(checkpoints):
    served = Served(checkpoints["qwen3_moe"], True)
    [child] = served.children()
    with _streaming(served, 4000) as lines:
        os.kill(served.process.pid, signal.SIGSTOP)  # the core hangs: no outputs, no state
        try:
            started = time.monotonic()
            last = [line for line in lines if line.startswith("data: ")][-1]
            assert time.monotonic() - started < 15
            assert last.startswith('data: {"error"') and "engine core has been silent" in last
            health = httpx.get(f"{served.url}/health", timeout=5)
            assert health.status_code == 503 and "silent" in health.json()["reason"]
        finally:
            os.kill(served.process.pid, signal.SIGCONT)
    wait_for(lambda: httpx.get(f"{served.url}/health", timeout=5).status_code == 200, 10, "the core to be heard again")
    with _streaming(served, 4000) as lines:
        next(line for line in lines if line.startswith("data: {"))  # a request in flight on the child
        os.kill(child, signal.SIGKILL)
    # the core keeps its model and engine: a new API process serves, the killed one's request was aborted
    wait_for(lambda: served.children() not in ([], [child]), 30, "a new API process")
    wait_for(lambda: _health(served) == 200, 60, "the new API process to serve")
    assert served.process.poll() is None
    assert served.complete(PROMPTS[0])["choices"][0]["text"]
    wait_for(lambda: served.metric("afd_requests_running") == 0, 30, "the killed process's request to be aborted")
    assert served.stop() == 0


def test_afd_up_1a1f_runs_the_api_of_its_attention_rank_in_a_child(checkpoints, servers, tmp_path):
    """An attention rank with a remote FFN (`afd up --topology 1A1F`, AFD_API_PROCESS=1): the same greedy text."""
    from tests.server.test_up import read_state

    one, _ = servers
    state_file, port = tmp_path / "state.json", _free_port()
    up = subprocess.Popen([sys.executable, "-m", "afd", "up", "--topology", "1A1F", "--model", str(checkpoints["qwen3_moe"]),
                           "--port", str(port), "--state-file", str(state_file), "--no-demo"],
                          env={**os.environ, "AFD_API_PROCESS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        state = wait_for(lambda: read_state(state_file), 240, "the state file")
        attention = next(r for r in state["ranks"] if r["role"] == "attention")
        wait_for(lambda: httpx.get(attention["metrics"].replace("/metrics", "/health")).status_code == 200, 120,
                 "the attention rank to be ready")
        [child] = [int(p) for t in Path(f"/proc/{attention['pid']}/task").iterdir() for p in (t / "children").read_text().split()]
        assert "afd.server.api_process" in Path(f"/proc/{child}/cmdline").read_text()
        body = {"model": one.model, "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        got = httpx.post(f"{attention['api']}/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert got == one.complete(PROMPTS[0])["choices"][0]["text"]
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0


def test_two_api_processes_share_the_port_and_each_answers_its_own_requests(checkpoints, servers):
    """AFD_API_SERVERS=2: two children bind the port (SO_REUSEPORT); 16 connections, spread by the kernel, each get
    the one-process server's greedy text; SIGTERM stops both."""
    from concurrent.futures import ThreadPoolExecutor

    one, _ = servers
    served = Served(checkpoints["qwen3_moe"], False, servers=2)
    try:
        children = served.children()
        assert len(children) == 2 and all("afd.server.api_process" in Path(f"/proc/{c}/cmdline").read_text()
                                          for c in children)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
        with ThreadPoolExecutor(16) as pool:  # httpx.post: a new connection per request
            texts = list(pool.map(lambda p: served.complete(p)["choices"][0]["text"], prompts))
        expected = {p: one.complete(p)["choices"][0]["text"] for p in PROMPTS}
        assert texts == [expected[p] for p in prompts]
    finally:
        assert served.stop() == 0
    assert not any(Path(f"/proc/{c}").exists() for c in children)


def test_sigterm_while_the_api_process_starts_is_a_clean_stop(checkpoints):
    """SIGTERM reaching the child before it set its handlers ends it by the signal: the core still exits 0."""
    port, metrics = _free_port(), _free_port()
    env = {**os.environ, "AFD_API_PROCESS": "1", "AFD_HTTP_HOST": "127.0.0.1", "AFD_HTTP_PORT": str(port),
           "AFD_METRICS_PORT": str(metrics), "AFD_DEVICE": "cpu", "AFD_KV_CACHE_BYTES": str(64 << 20)}
    core = subprocess.Popen([sys.executable, "-m", "afd", "serve", "--role", "monolithic", "--model",
                             str(checkpoints["qwen3_moe"])], env=env, stderr=subprocess.DEVNULL)
    try:
        tasks = Path(f"/proc/{core.pid}/task")
        wait_for(lambda: any((t / "children").read_text().split() for t in tasks.iterdir()), 120, "the API child")
        core.send_signal(signal.SIGTERM)  # the child is still importing: the core's SIGTERM kills it outright
        assert core.wait(timeout=60) == 0
    finally:
        if core.poll() is None:
            core.kill()
