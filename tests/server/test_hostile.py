"""Hostile input against a live `afd up` (1A1F, tiny model), through its front door.

Every numeric field gets NaN, ±Infinity, huge, negative and wrong-typed values; every
string field huge and malformed ones; every list huge counts; bodies come broken, deep,
oversized and in pieces. Each answer must be a 4xx in the OpenAI error format naming the
field (never a 5xx, never a hang). Clients that leave are aborted within a step or so, the
gauges say so at once, and afterwards the deployment is healthy, answers the same greedy
output as before and each rank's RSS is within 20 % of its start. Last, SIGTERM stops
`afd up` promptly with a request still in flight.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest

from afd.local.children import free_port_block
from tests.runtime.test_generate_cli import processes_with_marker
from tests.server.test_up import read_state, wait_for

MAX_BODY = 1 << 20  # `--max-request-bytes` of the deployment under test
MAX_PROMPTS = 16
CONTEXT = 4096  # the tiny qwen3_moe's context: prompts over 32 x 4096 characters are refused untokenized
TIMEOUT = httpx.Timeout(30.0, connect=5.0)  # "no hang": every answer within this
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GREEDY = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
pytestmark = pytest.mark.timeout(300)  # the first test also waits for `afd up` to start (about a minute on 2 busy cores)


@dataclass
class Deployment:
    process: subprocess.Popen
    url: str  # the front door, without /v1
    rank_url: str  # attention rank 0's API
    rank_metrics: str
    model: str
    pids: dict[str, int]
    marker: str
    greedy_before: tuple = ()
    rss_before: dict | None = None

    def post(self, path: str, body: dict | None = None, **kw) -> httpx.Response:
        if body is not None:
            kw["content"] = json.dumps(body).encode()
        return httpx.post(f"{kw.pop('base', self.url)}{path}", headers={"content-type": "application/json"},
                          timeout=TIMEOUT, **kw)

    def greedy(self) -> tuple[str, str]:
        text = self.post(COMPLETIONS, {"model": self.model, **GREEDY}).json()["choices"][0]["text"]
        chat = {"model": self.model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12, "temperature": 0}
        return text, self.post(CHAT, chat).json()["choices"][0]["message"]["content"]

    def rss(self) -> dict[str, int]:
        return {name: _rss_kib(pid) for name, pid in self.pids.items()}

    def gauge(self, name: str) -> float:
        for line in httpx.get(self.rank_metrics, timeout=TIMEOUT).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} is not exported")


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None  # not listening yet


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module")
def up(checkpoints, tmp_path_factory):
    marker = uuid.uuid4().hex
    port = free_port_block(1)
    state_file = tmp_path_factory.mktemp("hostile") / "state.json"
    args = [sys.executable, "-m", "afd", "up", "--model", str(checkpoints["qwen3_moe"]), "--topology", "1A1F",
            "--stages", "1", "--port", str(port), "--state-file", str(state_file), "--no-demo",
            "--max-request-bytes", str(MAX_BODY), "--max-prompts", str(MAX_PROMPTS), "--read-timeout", "60"]
    process = subprocess.Popen(args, env={**os.environ, "AFD_TEST_MARKER": marker},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        state = wait_for(lambda: read_state(state_file), 240, "the state file")
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _status(f"{url}/health") == 200, 60, "the front door")
        attention = next(r for r in state["ranks"] if r["role"] == "attention")
        deployment = Deployment(
            process, url, attention["api"].removesuffix("/v1"), attention["metrics"],
            httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["data"][0]["id"],
            {f"{r['role']}-{r['rank']}": r["pid"] for r in state["ranks"]}, marker)
        for _ in range(3):  # warm every path once before measuring
            deployment.greedy_before = deployment.greedy()
        deployment.rss_before = deployment.rss()
        yield deployment
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


# -- the cases -----------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
BAD_NUMBERS = {"nan": NAN, "inf": INF, "-inf": -INF, "huge": 10**30, "huge_float": 1e308, "negative": -5,
               "string": "1", "list": [1], "object": {"a": 1}, "bool": True}
NUMERIC_FIELDS = {
    COMPLETIONS: ("temperature", "top_p", "top_k", "seed", "max_tokens", "n", "logprobs", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "best_of", "prompt_logprobs"),
    CHAT: ("temperature", "top_p", "top_k", "seed", "max_tokens", "max_completion_tokens", "top_logprobs"),
}
VALID = {("seed", "negative")}  # seeds take -2**63..2**64-1, as torch does


def base(path: str) -> dict:
    if path == COMPLETIONS:
        return {"prompt": "Hi", "max_tokens": 2}
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True}


@dataclass
class Case:
    id: str
    path: str
    body: dict | None = None  # merged over base(path) and the model; a key set to ... is removed
    status: int = 400
    param: str | None = None  # the error's param starts with this
    raw: bytes | None = None  # sent as is instead of a body
    direct: bool = False  # to the attention rank, not the front door


def _cases() -> list[Case]:
    cases = []
    for path, fields in NUMERIC_FIELDS.items():
        for field in fields:
            for label, value in BAD_NUMBERS.items():
                ok = (field, label) in VALID
                cases.append(Case(f"{path[4:]}-{field}-{label}", path, {field: value}, status=200 if ok else 400,
                                  param=None if ok else field))
    huge = "x" * (40 * CONTEXT)  # over the prompt limit, under the body limit
    surrogate = "a\ud800b"
    cases += [
        Case("model-huge", COMPLETIONS, {"model": "m" * (MAX_BODY // 2)}, 404, "model"),
        Case("model-surrogate", COMPLETIONS, {"model": surrogate}, 400, "model"),
        Case("model-number", COMPLETIONS, {"model": 5}, 400, "model"),
        Case("model-missing", COMPLETIONS, {"model": ...}, 400, "model"),
        Case("prompt-huge", COMPLETIONS, {"prompt": huge}, 400, "prompt"),
        Case("prompt-surrogate", COMPLETIONS, {"prompt": surrogate}, 400, "prompt"),
        Case("prompt-low-surrogate", COMPLETIONS, {"prompt": "\udfff"}, 400, "prompt"),
        Case("prompt-surrogate-in-list", COMPLETIONS, {"prompt": ["ok", surrogate]}, 400, "prompt"),
        Case("prompt-empty", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
        Case("prompt-nul-is-text", COMPLETIONS, {"prompt": "a\u0000b\uffff"}, 200),
        Case("prompt-object", COMPLETIONS, {"prompt": {"a": 1}}, 400, "prompt"),
        Case("prompt-nan", COMPLETIONS, {"prompt": NAN}, 400, "prompt"),
        Case("prompt-float-ids", COMPLETIONS, {"prompt": [1.5, 2]}, 400, "prompt"),
        Case("prompt-negative-id", COMPLETIONS, {"prompt": [-1]}, 400, "prompt"),
        Case("prompt-huge-id", COMPLETIONS, {"prompt": [2**64]}, 400, "prompt"),
        Case("prompt-mixed", COMPLETIONS, {"prompt": ["a", [1]]}, 400, "prompt"),
        Case("stop-huge", COMPLETIONS, {"stop": "s" * 5000}, 400, "stop"),
        Case("stop-surrogate", COMPLETIONS, {"stop": [surrogate]}, 400, "stop"),
        Case("stop-empty", COMPLETIONS, {"stop": [""]}, 400, "stop"),
        Case("stop-number", COMPLETIONS, {"stop": 5}, 400, "stop"),
        Case("user-surrogate", COMPLETIONS, {"user": surrogate}, 400, "user"),
        Case("key-surrogate", COMPLETIONS, {"\ud800": 1}, 400),
        Case("content-huge", CHAT, {"messages": [{"role": "user", "content": huge}]}, 400, "messages"),
        Case("content-surrogate", CHAT, {"messages": [{"role": "user", "content": surrogate}]}, 400, "messages"),
        Case("content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        Case("role-huge", CHAT, {"messages": [{"role": "r" * 100_000, "content": "x"}]}, 400, "messages[0].role"),
        Case("name-surrogate", CHAT, {"messages": [{"role": "user", "content": "x", "name": surrogate}]}, 400, "messages"),
        Case("message-unknown-key", CHAT, {"messages": [{"role": "user", "content": "x", "foo": 1}]}, 400, "messages[0].foo"),
        Case("part-image", CHAT, {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
            400, "messages[0].content[1]"),
        Case("part-audio", CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
             400, "messages[0].content[0]"),
        Case("part-unknown", CHAT, {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, 400, "messages"),
        Case("part-text-number", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
             400, "messages[0].content[0].text"),
        Case("tool-calls", CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]}, 400, "messages"),
        # lists with huge counts
        Case("prompts-10000", COMPLETIONS, {"prompt": ["a"] * 10_000}, 400, "prompt"),
        Case("prompts-over-limit", COMPLETIONS, {"prompt": [[5, 6]] * (MAX_PROMPTS + 1)}, 400, "prompt"),
        Case("prompt-ids-100000", COMPLETIONS, {"prompt": [5] * 100_000}, 400, "prompt"),
        Case("stop-10000", COMPLETIONS, {"stop": ["s"] * 10_000}, 400, "stop"),
        Case("stop-token-ids-100000", COMPLETIONS, {"stop_token_ids": [1] * 100_000}, 400, "stop_token_ids"),
        Case("messages-10000", CHAT, {"messages": [{"role": "user", "content": "x"}] * 10_000}, 400, "messages"),
        Case("messages-empty", CHAT, {"messages": []}, 400, "messages"),
        Case("parts-10000", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 10_000}]},
             400, "messages[0].content"),
        Case("logit-bias-10000", COMPLETIONS, {"logit_bias": {str(i): 1 for i in range(10_000)}}, 400, "logit_bias"),
        # fields we do not implement
        Case("logit-bias-out-of-range", COMPLETIONS, {"logit_bias": {"5": 500}}, 400, "logit_bias"),
        Case("response-format", CHAT, {"response_format": {"type": "xml"}}, 400, "response_format"),
        Case("tools-not-function", CHAT, {"tools": [{"type": "retrieval"}]}, 400, "tools[0]"),
        Case("tools-parameters-string", CHAT, {"tools": [{"type": "function", "function": {"name": "f",
             "parameters": "{}"}}]}, 400, "tools[0].function.parameters"),
        Case("tool-choice-unknown", CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}],
             "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
        Case("tool-choice-without-tools", CHAT, {"tool_choice": "required"}, 400, "tool_choice"),
        Case("tool-call-arguments-object", CHAT, {"messages": [{"role": "assistant", "tool_calls": [
             {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]}, 400,
             "messages[0].tool_calls[0].function.arguments"),
        Case("best-of-streamed", COMPLETIONS, {"best_of": 2, "stream": True}, 400, "best_of"),
        Case("suffix", COMPLETIONS, {"suffix": "tail"}, 400, "suffix"),
        Case("unknown-field", COMPLETIONS, {"frobnicate": True}, 400, "frobnicate"),
        Case("stream-many-prompts", COMPLETIONS, {"prompt": ["a", "b"], "stream": True}, 400, "prompt"),
        Case("top-logprobs-without-logprobs", CHAT, {"logprobs": False, "top_logprobs": 2}, 400, "top_logprobs"),
        Case("stream-options-without-stream", COMPLETIONS, {"stream_options": {"include_usage": True}}, 400,
             "stream_options"),
        # broken bodies
        Case("body-invalid-utf8", COMPLETIONS, raw=b'{"model": "m", "prompt": "\xff\xfe"}'),
        Case("body-deep", COMPLETIONS, raw=b"[" * 100_000 + b"]" * 100_000),
        Case("body-deep-field", COMPLETIONS, {"prompt": json.loads("[" * 40 + "]" * 40)}, 400, "prompt"),
        Case("body-deep-direct", COMPLETIONS, raw=b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", direct=True),
        Case("body-not-object", COMPLETIONS, raw=b"[1, 2]"),
        Case("body-empty", CHAT, raw=b""),
        Case("body-truncated", CHAT, raw=b'{"model": "m", "messages": [{"role": "us'),
        Case("body-huge-int", COMPLETIONS, raw=b'{"seed": ' + b"9" * 10_000 + b"}"),
        Case("body-over-limit", COMPLETIONS, raw=b" " * (MAX_BODY + 1), status=413),
        Case("body-over-limit-direct", COMPLETIONS, raw=b" " * (MAX_BODY + 1), status=413, direct=True),
    ]
    return cases


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_request_gets_a_4xx_naming_the_field(up, case):
    target = {"base": up.rank_url} if case.direct else {}
    if case.raw is not None:
        response = up.post(case.path, content=case.raw, **target)
    else:
        body = {"model": up.model, **base(case.path), **case.body}
        response = up.post(case.path, {k: v for k, v in body.items() if v is not ...}, **target)
    assert response.status_code == case.status, response.text[:300]
    assert len(response.content) < 4096  # nothing huge is echoed back
    if case.status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == case.status
        assert error["type"] == ("not_found_error" if case.status == 404 else "invalid_request_error")
        if case.param:
            assert (error["param"] or "").startswith(case.param), error


def test_a_body_sent_in_chunks_over_the_limit_gets_413(up):
    def chunks():
        for _ in range(MAX_BODY // 65536 + 2):
            yield b" " * 65536

    response = httpx.post(f"{up.url}{COMPLETIONS}", content=chunks(), timeout=TIMEOUT)
    assert response.status_code == 413 and "AFD_MAX_REQUEST_BYTES" in response.json()["error"]["message"]


def test_text_parts_are_joined_like_a_string(up):
    def chat(content):
        body = {"model": up.model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
        return up.post(CHAT, body).json()["choices"][0]["message"]["content"]

    assert chat([{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]) == chat("Hello\nthere")


def test_logprobs_return_exactly_what_they_promise(up):
    body = {"model": up.model, "prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 20}
    logprobs = up.post(COMPLETIONS, body).json()["choices"][0]["logprobs"]
    assert [len(top) for top in logprobs["top_logprobs"]] == [20] * 4
    chat = {"model": up.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 20}
    content = up.post(CHAT, chat).json()["choices"][0]["logprobs"]["content"]
    assert [len(entry["top_logprobs"]) for entry in content] == [20] * len(content) and content


def test_completion_ids_are_unique(up):
    body = {"model": up.model, "prompt": "Hi", "max_tokens": 1}
    ids = {up.post(COMPLETIONS, body).json()["id"] for _ in range(3)}
    assert len(ids) == 3 and all(i.startswith("cmpl-") and len(i) >= 32 for i in ids)


def _wait_idle(up, seconds: float) -> float:
    """Seconds until attention rank 0's gauges say nothing runs, waits or holds KV cache."""
    started = time.monotonic()
    wait_for(lambda: up.gauge("afd_requests_running") == 0 and up.gauge("afd_requests_waiting") == 0
             and up.gauge("afd_kv_cache_usage_ratio") == 0, seconds, "the rank to drop the abandoned work")
    return time.monotonic() - started


LONG = {"prompt": "Once upon a time", "max_tokens": CONTEXT - 16, "ignore_eos": True}


@pytest.mark.parametrize("shape", ["whole", "stream", "many-prompts"])
def test_a_client_that_leaves_is_aborted_through_the_front_door(up, shape):
    body = {"model": up.model, **LONG}
    if shape == "many-prompts":
        body["prompt"] = [[5, 6, 7 + i] for i in range(MAX_PROMPTS)]
    if shape == "stream":
        with httpx.stream("POST", f"{up.url}{COMPLETIONS}", json={**body, "stream": True}, timeout=TIMEOUT) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the connection at once
            for line in lines:
                if line.startswith("data: "):
                    break
            assert up.gauge("afd_requests_running") == 1, line
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after a second, like `curl -m1`
            httpx.post(f"{up.url}{COMPLETIONS}", json=body, timeout=httpx.Timeout(1.0, connect=5.0))
    generated = up.gauge("afd_generation_tokens_total")
    assert _wait_idle(up, 5) < 5
    time.sleep(0.5)
    assert up.gauge("afd_generation_tokens_total") - generated < 2 * CONTEXT // 4  # it stopped, far short of the end


def test_the_front_door_serves_every_ranks_metrics(up):
    text = httpx.get(f"{up.url}/metrics", timeout=TIMEOUT).text
    for needle in ('afd_front_requests_total{status="4xx"}', 'afd_front_scrape_up{target="ffn-0"} 1.0',
                   'afd_requests_running{rank="0",role="attention"}', 'afd_rejected_messages_total{rank="0",reason="control",role="ffn"} 0.0',
                   'afd_peer_up{peer="0",rank="0",role="ffn"}', 'afd_weights_resident_bytes{rank="0",role="attention"}',
                   'afd_weights_resident_bytes{rank="0",role="ffn"}',
                   'afd_kernel_compiles_total{rank="0",role="attention"} 0.0', 'afd_kernel_compiles_total{rank="0",role="ffn"} 0.0'):
        assert needle in text, needle
    assert text.count("# TYPE afd_step_duration_seconds histogram") == 1  # one family, both roles' series


def test_after_the_onslaught_the_deployment_is_healthy_unchanged_and_lean(up):
    assert httpx.get(f"{up.url}/health", timeout=TIMEOUT).status_code == 200
    assert httpx.get(f"{up.rank_url}/health", timeout=TIMEOUT).status_code == 200
    assert up.greedy() == up.greedy_before
    after = up.rss()
    print(f"\nRSS KiB before {up.rss_before} after {after}")
    for name, before in up.rss_before.items():
        assert after[name] <= 1.2 * before, f"{name}: RSS {before} KiB -> {after[name]} KiB"


def test_sigterm_stops_afd_up_promptly_with_a_request_in_flight(up):
    results = {}

    def hang_on():
        try:
            results["status"] = httpx.post(f"{up.url}{COMPLETIONS}", json={"model": up.model, **LONG}, timeout=60).status_code
        except httpx.HTTPError as err:
            results["status"] = type(err).__name__

    client = threading.Thread(target=hang_on, daemon=True)
    client.start()
    wait_for(lambda: up.gauge("afd_requests_running") == 1, 10, "the request to run")
    started = time.monotonic()
    up.process.send_signal(signal.SIGTERM)
    up.process.wait(timeout=30)
    took = time.monotonic() - started
    client.join(10)
    assert up.process.returncode == 0, up.process.stderr.read()[-2000:]
    assert took < 25, f"afd up took {took:.1f} s to stop"  # 5 s relay grace + 5 s rank grace + exits
    assert wait_for(lambda: processes_with_marker(up.marker) == [] or None, 15, "every process to stop") is not None
    assert "status" in results  # the client got an answer or a closed connection, not silence
