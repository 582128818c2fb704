"""Prefix caching on real processes (`afd up`, zmq): requests on a shared prefix sent to one attention rank report
`usage.prompt_tokens_details.cached_tokens` (whole, streamed, chat) and give the same text as the same request
computed in full; `cache_salt` separates tenants; the rank exports the hit counts. 2A1F with 2 stages and the gate on
the FFN, 1A1F with 1 stage and the gate on attention. (The front door's prefix-aware choice of rank is the router's:
these requests go to one rank's own port.)"""

import os
import re
import signal
import subprocess
import sys
import uuid

import httpx
import pytest

from afd.local.children import free_port_block
from tests.runtime.test_generate_cli import processes_with_marker
from tests.server.test_up import read_state, wait_for

SHARED = [(7 * i + 11) % 150 + 20 for i in range(50)]  # 3 full blocks of 16 and 2 tokens
FULL_BLOCKS = 48
QUESTIONS = 10


def complete(api, model, prompt, salt=None, stream=False, max_tokens=8):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    if not stream:
        answer = httpx.post(f"{api}/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        reply = answer.json()
        return reply["choices"][0]["text"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    body.update(stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    with httpx.stream("POST", f"{api}/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                text += "".join(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    return text, usage["prompt_tokens_details"]["cached_tokens"]


def series(api, name) -> float:
    text = httpx.get(api.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("flags", [["--topology", "2A1F", "--stages", "2", "--gate", "ffn"],
                                   ["--topology", "1A1F", "--stages", "1", "--gate", "attention"]],
                         ids=["2A1F-stages2", "1A1F-stages1-gate-attention"])
def test_shared_prefix_requests_on_a_rank_hit_its_cache_and_equal_full_prefills(tmp_path, flags):
    marker, port, state_file = uuid.uuid4().hex, free_port_block(1), tmp_path / "state.json"
    env = {**os.environ, "AFD_TEST_MARKER": marker, "AFD_CACHE_DIR": str(tmp_path / "cache")}
    up = subprocess.Popen([sys.executable, "-m", "afd", "up", *flags, "--port", str(port), "--state-file",
                           str(state_file), "--no-demo"], env=env, stdout=subprocess.DEVNULL,
                          stderr=open(tmp_path / "up.log", "w"))
    try:
        state = wait_for(lambda: read_state(state_file), 240, "the state file")
        rank = next(r for r in state["ranks"] if r["role"] == "attention" and r["rank"] == 0)["api"]
        model = httpx.get(f"{rank}/models").json()["data"][0]["id"]
        prompts = [SHARED + [30 + q, 31 + q, 32 + q] for q in range(QUESTIONS)]
        answers = [complete(rank, model, prompt, stream=q % 3 == 2) for q, prompt in enumerate(prompts)]
        hits = [cached for _, cached in answers[1:]]
        assert sum(cached >= FULL_BLOCKS for cached in hits) >= 0.9 * len(hits), hits
        full = [complete(rank, model, prompt, salt=uuid.uuid4().hex) for prompt in prompts]  # each salt new: no hit
        assert [cached for _, cached in full] == [0] * QUESTIONS
        assert [text for text, _ in answers] == [text for text, _ in full]
        # a prefix cached under one salt is never a hit under another or none
        fresh = [(5 * i + 3) % 140 + 25 for i in range(40)]
        assert complete(rank, model, fresh, salt="tenant-a")[1] == 0
        assert complete(rank, model, fresh, salt="tenant-b")[1] == 0
        assert complete(rank, model, fresh)[1] == 0
        assert complete(rank, model, fresh, salt="tenant-a")[1] == 32
        chat = {"model": model, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": "You answer briefly. " * 12},
                             {"role": "user", "content": "Which colour is the sky?"}]}
        usages = [httpx.post(f"{rank}/chat/completions", json=chat, timeout=120).json()["usage"] for _ in range(2)]
        assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 16
        assert series(rank, "afd_prefix_cache_hits_total") >= FULL_BLOCKS * (QUESTIONS - 1)
        assert series(rank, "afd_prefix_cache_queries_total") >= series(rank, "afd_prefix_cache_hits_total")
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert wait_for(lambda: processes_with_marker(marker) == [] or None, 15, "every process to stop")
