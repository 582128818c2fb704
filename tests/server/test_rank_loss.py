"""No request lost when a rank dies (issue 38), on real processes behind `afd up`'s front door.

Every prompt starts with one shared system prefix (issue 51): the disturbed runs hit the prefix cache that the
undisturbed runs filled, so moved and held streams also go on over shared, cached blocks.

8 concurrent streams of 256 tokens (64 in the n-choices test); kill -9 an FFN rank mid-stream (its attention ranks hold their requests and
go on once it is restarted), then an attention rank mid-stream (the front door moves its streams to another
rank): every stream completes, no error event, each text equal to the same request's undisturbed text, usage
counting every token once. Greedy, and seeded with temperature 1.
"""

import json
import os
import re
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

STREAMS, TOKENS, NOT_STREAMED = 8, 64, 2
# the FFN-then-attention test's streams: long enough that attention rank 0 still has streams under way when it is
# killed just after its held streams resumed (at 64 tokens they ended within the health poll: 0-2 moved)
LONG_TOKENS = 256
SHARED_PREFIX = ("You are a patient storyteller. Every story has a beginning, a middle and an end, and each one "
                 "is told in plain words for a young reader. ")


class Stream:
    """One streamed request through the front door: its text, events, error and longest pause."""

    def __init__(self, api: str, model: str, index: int, sampling: dict, tokens: int = TOKENS):
        self.index, self.chat, self.streamed = index, index % 2 == 1, index < STREAMS
        prompt = f"{SHARED_PREFIX}Tell me story number {index}"
        body = {"model": model, "max_tokens": tokens, "ignore_eos": True, "stream": self.streamed, **sampling}
        if self.streamed:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            self.url, self.body = f"{api}/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
        else:
            self.url, self.body = f"{api}/completions", {**body, "prompt": prompt}
        self.text, self.ids, self.indexes, self.roles, self.texts = "", set(), set(), 0, {}
        self.events, self.error, self.usage, self.finish, self.done, self.longest_pause = 0, None, None, None, False, 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = None
        if not self.streamed:  # one answer: retried on another rank if its rank dies before it
            try:
                answer = httpx.post(self.url, json=self.body, timeout=120)
                if answer.status_code != 200:
                    self.error = answer.text
                    return
                choice = answer.json()["choices"][0]
                self.text = choice["message"]["content"] if self.chat else choice["text"]
                self.texts = {c["index"]: c["message"]["content"] if self.chat else c["text"]
                              for c in answer.json()["choices"]}
                self.finish, self.usage, self.done, self.indexes = choice["finish_reason"], answer.json()["usage"], True, {0}
                self.ids, self.events = {answer.json()["id"]}, 1
            except httpx.HTTPError as err:
                self.error = f"{type(err).__name__}: {err}"
            return
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as response:
                for line in response.iter_lines():
                    now = time.monotonic()
                    if last is not None:
                        self.longest_pause = max(self.longest_pause, now - last)
                    last = now
                    if line == "data: [DONE]":
                        self.done = True
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = chunk["error"]["message"]
                        return
                    self.ids.add(chunk["id"])
                    if chunk.get("usage"):
                        self.usage = chunk["usage"]
                    for choice in chunk["choices"]:
                        self.indexes.add(choice["index"])
                        self.events += 1
                        if self.chat:
                            self.roles += "role" in choice["delta"]
                            piece = choice["delta"].get("content") or ""
                        else:
                            piece = choice["text"]
                        self.text += piece
                        self.texts[choice["index"]] = self.texts.get(choice["index"], "") + piece
                        self.finish = choice["finish_reason"] or self.finish
        except httpx.HTTPError as err:
            self.error = f"{type(err).__name__}: {err}"


def run_all(api, model, sampling, during=None, tokens=TOKENS) -> list[Stream]:
    streams = [Stream(api, model, i, sampling, tokens) for i in range(STREAMS + NOT_STREAMED)]
    for stream in streams:
        stream.thread.start()
    if during is not None:
        during(streams)
    for stream in streams:
        stream.thread.join(180)
    return streams


def pid_of(state_file, role, rank):
    state = read_state(state_file)
    return next(r["pid"] for r in state["ranks"] if r["role"] == role and r["rank"] == rank) if state else None


def healthy(api) -> bool:
    try:
        return httpx.get(api.removesuffix("/v1") + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def front_series(api, name) -> float:
    text = httpx.get(api.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("topology", ["2A1F", "2A2F"])
def test_killing_the_ffn_then_an_attention_rank_mid_stream_loses_no_request(tmp_path, topology):
    marker = uuid.uuid4().hex
    port = free_port_block(1)
    state_file = tmp_path / "state.json"
    env = {**os.environ, "AFD_TEST_MARKER": marker, "AFD_CACHE_DIR": str(tmp_path / "cache")}
    up = subprocess.Popen([sys.executable, "-m", "afd", "up", "--topology", topology, "--port", str(port),
                           "--state-file", str(state_file), "--no-demo"], env=env, stdout=subprocess.DEVNULL,
                          stderr=open(tmp_path / "up.log", "w"))
    try:
        state = wait_for(lambda: read_state(state_file), 240, "the state file")
        api = state["api"]
        rank = {(r["role"], r["rank"]): r for r in state["ranks"]}
        attention0 = rank[("attention", 0)]["api"]
        model = httpx.get(f"{api}/models").json()["data"][0]["id"]

        def kill_ffn_then_attention(streams):
            wait_for(lambda: min(s.events for s in streams if s.streamed) >= 4, 60, "every stream under way")
            ffn_pid = pid_of(state_file, "ffn", 0)
            os.kill(ffn_pid, signal.SIGKILL)
            wait_for(lambda: pid_of(state_file, "ffn", 0) not in (None, ffn_pid) and healthy(attention0), 120,
                     "the FFN rank restarted and attention rank 0 serving again")
            os.kill(pid_of(state_file, "attention", 0), signal.SIGKILL)  # its held streams have just gone on

        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 1234}):
            undisturbed = run_all(api, model, sampling, tokens=LONG_TOKENS)
            assert all(s.error is None and s.done for s in undisturbed), [s.error for s in undisturbed]
            moved_before = front_series(api, "afd_front_requests_moved_total")
            disturbed = run_all(api, model, sampling, kill_ffn_then_attention, tokens=LONG_TOKENS)
            for before, after in zip(undisturbed, disturbed):
                assert after.error is None and after.done and after.finish == "length", (after.index, after.error)
                assert after.text == before.text, (after.index, before.text, after.text)
                assert len(after.ids) == 1 and after.indexes == {0} and after.roles == (after.chat and after.streamed)
                assert after.usage["completion_tokens"] == LONG_TOKENS == before.usage["completion_tokens"]
                assert after.usage["prompt_tokens"] == before.usage["prompt_tokens"]
            assert max(s.longest_pause for s in disturbed if s.streamed) > 0.5  # streams were held while the FFN was down
            cached = [s.usage["prompt_tokens_details"]["cached_tokens"] for s in disturbed]
            assert sum(c > 0 for c in cached) >= STREAMS // 2, cached  # on the prefix the undisturbed run cached
            moved = front_series(api, "afd_front_requests_moved_total") - moved_before
            assert moved > 0  # and moved from the killed rank
            waits = front_series(api, "afd_front_move_wait_seconds_sum")
            print(f"\n{topology} {sampling}: {STREAMS} streams + {NOT_STREAMED} non-streamed complete, texts equal; "
                  f"longest pause {max(s.longest_pause for s in disturbed if s.streamed):.1f} s (FFN restart), "
                  f"{moved:.0f} streams moved, move waits so far {waits:.3f} s in all")
            wait_for(lambda: healthy(attention0) and healthy(api), 120, "attention rank 0 back")
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert wait_for(lambda: processes_with_marker(marker) == [] or None, 15, "every process to stop")


@pytest.mark.timeout(300)
def test_n_streams_move_each_choice_when_their_attention_rank_dies(tmp_path):
    """n = 2 streams through the front door; kill -9 attention rank 0 mid-stream: each choice goes on from its own
    tokens on the other rank, equal to the undisturbed choice, usage counting every token once."""
    marker, port, state_file = uuid.uuid4().hex, free_port_block(1), tmp_path / "state.json"
    env = {**os.environ, "AFD_TEST_MARKER": marker, "AFD_CACHE_DIR": str(tmp_path / "cache")}
    up = subprocess.Popen([sys.executable, "-m", "afd", "up", "--topology", "2A1F", "--port", str(port),
                           "--state-file", str(state_file), "--no-demo"], env=env, stdout=subprocess.DEVNULL,
                          stderr=open(tmp_path / "up.log", "w"))
    try:
        api = wait_for(lambda: read_state(state_file), 240, "the state file")["api"]
        model = httpx.get(f"{api}/models").json()["data"][0]["id"]
        sampling = {"temperature": 1.0, "seed": 77, "n": 2}

        def kill_attention(streams):
            wait_for(lambda: min(s.events for s in streams if s.streamed) >= 8, 60, "every stream under way")
            os.kill(pid_of(state_file, "attention", 0), signal.SIGKILL)

        undisturbed = run_all(api, model, sampling)
        disturbed = run_all(api, model, sampling, kill_attention)
        for before, after in zip(undisturbed, disturbed):
            assert after.error is None and after.done, (after.index, after.error)
            assert after.texts == before.texts and set(after.texts) == {0, 1}, (after.index, before.texts, after.texts)
            counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: what each run found cached
            assert [after.usage[k] for k in counts] == [before.usage[k] for k in counts]
            assert after.usage["completion_tokens"] == 2 * TOKENS
            assert after.roles == (2 if after.chat and after.streamed else 0)
        assert front_series(api, "afd_front_requests_moved_total") > 0
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert wait_for(lambda: processes_with_marker(marker) == [] or None, 15, "every process to stop")
