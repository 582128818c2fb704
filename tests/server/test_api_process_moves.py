"""A stream moves onto a rank whose API runs in its own process (`AFD_API_PROCESS`): the rank takes the signed
resume header, the core continues from the carried tokens, and the API process replays their text, so the client's
text goes on as the undisturbed stream's did (issue 51: the limit the README named is lifted)."""

from __future__ import annotations

import json

import httpx
import pytest

from afd.server.api.resume import IDS_HEADER, RESUME_HEADER, Resume, sign
from tests.server.test_api_process import Served

SECRET = "moves-to-api-processes"


@pytest.fixture(scope="module")
def split(checkpoints):
    served = Served(checkpoints["qwen3_moe"], True, extra_env={"AFD_GROUP_SECRET": SECRET})
    try:
        yield served
    finally:
        if served.process.poll() is None:
            served.process.kill()


def _stream(served: Served, path: str, headers: dict, body: dict) -> tuple[int, list[dict], list[list[int]], str]:
    response = httpx.post(f"{served.url}/v1/{path}", json=body, headers=headers, timeout=60)
    chunks, ids = [], []
    for event in response.text.split("\n\n"):
        lines = event.split("\n")
        ids += [[int(t) for t in line[len(": afd-ids "):].split(",")] for line in lines if line.startswith(": afd-ids ")]
        chunks += [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return response.status_code, chunks, ids, response.text


def _text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                   for c in chunks if c["choices"])


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 77}], ids=["greedy", "seeded"])
def test_an_api_process_rank_continues_a_moved_stream_as_the_undisturbed_one_goes_on(split, path, sampling):
    body = {"model": split.model, "max_tokens": 12, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if path.startswith("chat") else {"prompt": "Hello"})
    status, full, ids, _ = _stream(split, path, {IDS_HEADER: "1"}, body)
    assert status == 200 and len(ids) == 12
    carried = [t for per_event in ids[:5] for t in per_event]
    header = sign(SECRET.encode(), Resume(full[0]["id"], tuple(carried)))
    status, rest, rest_ids, text = _stream(split, path, {RESUME_HEADER: header}, body)
    assert status == 200, text
    assert rest_ids == []  # no ids asked for this time
    assert _text(full[:5]) + _text(rest) == _text(full)
    assert {c["id"] for c in rest} == {full[0]["id"]}
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens is what each run found
    assert [rest[-1]["usage"][k] for k in counts] == [full[-1]["usage"][k] for k in counts]  # every token once


def test_a_resume_signed_with_another_secret_is_refused_by_the_api_process(split):
    body = {"model": split.model, "prompt": "Hello", "max_tokens": 4, "stream": True}
    header = sign(b"not the group secret", Resume("cmpl-abc", (1, 2)))
    answer = httpx.post(f"{split.url}/v1/completions", json=body, headers={RESUME_HEADER: header}, timeout=60)
    assert answer.status_code == 400 and "not signed by this deployment" in answer.text


@pytest.mark.timeout(300)
def test_streams_move_off_a_killed_api_process_rank_behind_the_front_door(tmp_path):
    """`afd up` 2A1F with AFD_API_PROCESS=1 on every rank; kill -9 attention rank 0 (its core; the API process goes
    with it) mid-stream: the front door moves its streams to rank 1's API process, every text equal to the
    undisturbed one and usage counting every token once."""
    import os
    import signal
    import subprocess
    import sys
    import uuid

    from afd.local.children import free_port_block
    from tests.runtime.test_generate_cli import processes_with_marker
    from tests.server.test_rank_loss import front_series, pid_of, run_all
    from tests.server.test_up import read_state, wait_for

    marker, port, state_file = uuid.uuid4().hex, free_port_block(1), tmp_path / "state.json"
    env = {**os.environ, "AFD_TEST_MARKER": marker, "AFD_CACHE_DIR": str(tmp_path / "cache"), "AFD_API_PROCESS": "1"}
    up = subprocess.Popen([sys.executable, "-m", "afd", "up", "--topology", "2A1F", "--port", str(port),
                           "--state-file", str(state_file), "--no-demo"], env=env, stdout=subprocess.DEVNULL,
                          stderr=open(tmp_path / "up.log", "w"))
    try:
        api = wait_for(lambda: read_state(state_file), 240, "the state file")["api"]
        model = httpx.get(f"{api}/models").json()["data"][0]["id"]
        sampling = {"temperature": 1.0, "seed": 5}

        def kill_attention(streams):
            wait_for(lambda: min(s.events for s in streams if s.streamed) >= 8, 60, "every stream under way")
            os.kill(pid_of(state_file, "attention", 0), signal.SIGKILL)

        undisturbed = run_all(api, model, sampling)
        moved_before = front_series(api, "afd_front_requests_moved_total")
        disturbed = run_all(api, model, sampling, kill_attention)
        for before, after in zip(undisturbed, disturbed):
            assert after.error is None and after.done, (after.index, after.error)
            assert after.text == before.text, (after.index, before.text, after.text)
            counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: what each run found
            assert [after.usage[k] for k in counts] == [before.usage[k] for k in counts]
        assert front_series(api, "afd_front_requests_moved_total") > moved_before
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert wait_for(lambda: processes_with_marker(marker) == [] or None, 15, "every process to stop")
