"""Rank loss on the NCCL data plane (issues 20 and 38), as `afd serve` processes on two GPUs.

FFN rank on GPU 1, attention ranks (HTTP servers) on GPU 0, NCCL pairs, CUDA graphs, two
stages. `kill -9` of a rank while streams run; then a new process with the same
environment. Asserted: streams whose FFN rank dies are held (no error event, /health 503
while it is down) and complete once it is back, each text equal to the same streams'
undisturbed run, in the same attention processes; with AFD_FFN_HOLD_S=0 they end with an
explicit error event within 5 s as before. An attention rank killed in 2A1F: the other keeps
streaming, its texts unchanged, and the killed rank's streams, relayed by `afd up`'s front door,
move to it and complete (all tokens, same id, no error, the text before the kill unchanged).
The text checks run every process in batch-invariant mode (AFD_BATCH_INVARIANT=1), where a
token's result does not depend on what shares its step: in the default mode bf16 batches of
another make-up may round differently, and a disturbed stream joins other steps than its
undisturbed run. Figures go to stdout and, when AFD_GPU_RESULTS names a file, as JSON lines
there. Skipped without two GPUs (or AFD_GPU_SHARE_ONE=1 on one).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from tests.gpu.nccl_env import gpu_env, nccl_pairs

pytestmark = nccl_pairs
STREAM_TOKENS = int(os.environ.get("AFD_RECOVERY_STREAM_TOKENS", "3000"))  # fewer to fit a short device call
GROUP_SECRET = "gpu-recovery-test"
GREEDY = {"prompt": "Hello there", "max_tokens": 48, "temperature": 0, "ignore_eos": True}


class Group:
    """One AFD group of `afd serve` processes: FFN rank 0 on GPU 1, attention ranks on GPU 0."""

    def __init__(self, checkpoint, attention_ranks: int, processes, ffn_hold_s: float = 60.0, invariant: bool = False):
        from afd.config import AFDConfig, config_to_env
        from afd.local.children import free_port_block

        base = free_port_block(3 + 2 * attention_ranks)
        config = AFDConfig(
            num_attention_ranks=attention_ranks, num_ffn_ranks=1, connector="nccl", stages=2, model=str(checkpoint),
            dtype="bfloat16", device="cuda", cuda_graphs=True, max_num_seqs=16, peer_timeout_s=5.0,
            kv_cache_bytes=2 << 30,  # the attention ranks share GPU 0: a fixed cache each, not 0.9 of the GPU
            ffn_batch_window_s=0.002 if attention_ranks > 1 else 0.0, ffn_address_template="127.0.0.1",
            bind_host="127.0.0.1", http_host="127.0.0.1", control_port=base, data_port=base + 1,
            ffn_hold_s=ffn_hold_s, group_secret=GROUP_SECRET,
        )
        self.env = {**config_to_env(config), "AFD_BATCH_INVARIANT": "1" if invariant else "0"}
        self.ffn_metrics = base + 2
        self.http = [base + 3 + 2 * rank for rank in range(attention_ranks)]
        self.processes = processes

    def start_ffn(self):
        env = {**self.env, "AFD_ROLE": "ffn", "AFD_RANK": "0", "AFD_METRICS_PORT": str(self.ffn_metrics), **gpu_env("ffn-0", 1)}
        return self.processes.start("ffn-0", ["serve"], env)

    def start_attention(self, rank: int):
        env = {**self.env, "AFD_ROLE": "attention", "AFD_RANK": str(rank), "AFD_HTTP_PORT": str(self.http[rank]),
               "AFD_METRICS_PORT": str(self.http[rank] + 1), **gpu_env(f"attn-{rank}", 0)}
        return self.processes.start(f"attn-{rank}", ["serve"], env)

    def url(self, rank: int) -> str:
        return f"http://127.0.0.1:{self.http[rank]}"

    def kill(self, name: str) -> float:
        self.processes.children[name].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        self.processes.children[name].wait(10)
        return killed_at

    def healthy(self, rank: int) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url(rank)}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, ranks, timeout_s: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if all(self.healthy(rank) for rank in ranks):
                return time.monotonic() - started
            for name, child in self.processes.children.items():
                assert child.poll() is None, f"{name} exited:\n{self.log(name)}"
            time.sleep(0.1)
        raise AssertionError(f"ranks {list(ranks)} not healthy within {timeout_s:.0f} s:\n" +
                             "\n".join(f"--- {n} ---\n{self.log(n)}" for n in self.processes.children))

    def greedy(self, rank: int) -> str:
        import httpx

        reply = httpx.post(f"{self.url(rank)}/v1/completions", json={"model": self.model(rank), **GREEDY}, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    def model(self, rank: int) -> str:
        import httpx

        return httpx.get(f"{self.url(rank)}/v1/models", timeout=10).json()["data"][0]["id"]

    def metric(self, port: int, name: str) -> float:
        return self.metric_at(f"http://127.0.0.1:{port}/metrics", name)

    @staticmethod
    def metric_at(url: str, name: str) -> float:
        import httpx

        lines = httpx.get(url, timeout=10).text.splitlines()
        return sum(float(line.split()[-1]) for line in lines if line.startswith(name + "{") or line.startswith(name + " "))

    def log(self, name: str) -> str:
        return self.processes.log_path(name).read_text(errors="replace")[-5000:]


class Stream(threading.Thread):
    """One streaming completion of STREAM_TOKENS greedy tokens; keeps every chunk's arrival time and text."""

    def __init__(self, url: str, model: str):
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.times: list[float] = []
        self.pieces: list[str] = []  # each choice chunk's text, as `times`
        self.finish = self.error = self.usage = None
        self.text, self.ids = "", set()
        self.ended = 0.0

    def run(self) -> None:
        import httpx

        body = {"model": self.model, "prompt": "Hello", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True,
                "temperature": 0, "stream_options": {"include_usage": True}}
        try:  # a held stream pauses while its FFN rank restarts: the read timeout covers that
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=150) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = chunk["error"]["message"]
                        break
                    self.ids.add(chunk["id"])
                    self.usage = chunk.get("usage") or self.usage
                    for choice in chunk["choices"]:
                        self.times.append(time.monotonic())
                        self.pieces.append(choice["text"])
                        self.text += choice["text"]
                        self.finish = choice["finish_reason"] or self.finish
        except Exception as err:  # a dropped connection is a failure too, recorded
            self.error = f"{type(err).__name__}: {err}"
        self.ended = time.monotonic()

    def text_before(self, moment: float) -> str:
        """The text this stream had received by `moment`."""
        return "".join(piece for at, piece in zip(self.times, self.pieces) if at <= moment)


def start_streams(group: Group, rank: int, count: int, url: str | None = None) -> list[Stream]:
    streams = [Stream(url or group.url(rank), group.model(rank)) for _ in range(count)]
    for stream in streams:
        stream.start()
    deadline = time.monotonic() + 30
    while not all(len(s.times) > 20 for s in streams) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(s.times for s in streams), "the streams did not start"
    return streams


def report(name: str, figures: dict) -> None:
    print(f"\n{name}: " + json.dumps(figures))
    if path := os.environ.get("AFD_GPU_RESULTS"):
        with open(path, "a") as out:
            out.write(json.dumps({"test": name, **figures}) + "\n")


@pytest.fixture
def processes(request):
    """The group's children; their logs are appended to AFD_GPU_LOGS (one file) when it is set."""
    from afd.local.children import LocalProcesses

    with LocalProcesses() as children:
        yield children
    if path := os.environ.get("AFD_GPU_LOGS"):
        with open(path, "a") as out:
            for log in sorted(children.workdir.glob("*.log")):
                out.write(f"===== {request.node.name} {log.name}\n{log.read_text(errors='replace')[-30000:]}\n")


def join_all(streams: list[Stream], timeout_s: float) -> None:
    for stream in streams:
        stream.join(timeout_s)


def first_difference(text: str, reference: str) -> str:
    """Where `text` parts from `reference`, for an assertion's message."""
    at = next((i for i, (a, b) in enumerate(zip(text, reference)) if a != b), min(len(text), len(reference)))
    return f"parts at character {at} of {len(reference)}: {text[max(0, at - 30):at + 30]!r} != {reference[max(0, at - 30):at + 30]!r}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("attention_ranks", [1, 2], ids=["1A1F", "2A1F"])
def test_ffn_killed_mid_stream_is_held_and_every_stream_completes_unchanged(attention_ranks, checkpoints, processes):
    import httpx

    group = Group(checkpoints["deepseek_v2"], attention_ranks, processes, invariant=True)
    ranks = range(attention_ranks)
    group.start_ffn()
    attention = [group.start_attention(rank) for rank in ranks]
    group.wait_healthy(ranks, 300)
    before = [group.greedy(rank) for rank in ranks]
    count = 16 // attention_ranks
    undisturbed = [s for rank in ranks for s in start_streams(group, rank, count)]  # the same batches, no kill
    join_all(undisturbed, 300)
    assert all(s.error is None and s.finish == "length" for s in undisturbed), [s.error for s in undisturbed]
    streams = [s for rank in ranks for s in start_streams(group, rank, count)]

    killed_at = group.kill("ffn-0")
    time.sleep(2.0)  # the FFN rank stays down a while: the streams must wait for it, not fail
    assert not any(s.error for s in streams), [s.error for s in streams if s.error]
    assert not any(group.healthy(rank) for rank in ranks)
    down = httpx.post(f"{group.url(0)}/v1/completions", json={"model": group.model(0), **GREEDY}, timeout=30)
    assert down.status_code == 503
    group.start_ffn()
    recovered_in = group.wait_healthy(ranks, 90)
    join_all(streams, 200)
    held = [s for s in streams if s.ended > killed_at]
    assert held, "every stream finished before the kill: nothing was tested"
    for s in streams:  # whole, no error, every token once
        assert s.error is None and s.finish == "length" and len(s.times) == STREAM_TOKENS, (s.error, s.finish, len(s.times))
        assert s.usage["completion_tokens"] == STREAM_TOKENS
    # The same streams' undisturbed texts, equal: in batch-invariant mode the steps a stream joins (other ones in the
    # two runs, and the steps taken back and run again after the hold) do not change its tokens
    for index, (s, reference) in enumerate(zip(streams, undisturbed)):
        assert s.text == reference.text, f"stream {index} (held: {s in held}) {first_difference(s.text, reference.text)}"
    pauses = [max(b - a for a, b in zip(s.times, s.times[1:])) for s in held]
    assert [child.poll() for child in attention] == [None] * attention_ranks  # the same attention processes
    assert [group.greedy(rank) for rank in ranks] == before
    resumed = [group.metric(group.http[rank] + 1, "afd_requests_resumed_total") for rank in ranks]
    assert sum(resumed) >= len(held)
    report(f"ffn_killed_held_{attention_ranks}A1F", {
        "streams": len(streams), "held": len(held), "resumed": resumed, "text_equal_undisturbed": f"{len(streams)}/{len(streams)}", "longest_pause_s": round(max(pauses), 2),
        "serving_again_after_ffn_start_s": round(recovered_in, 2),
        "hold_seconds_sum": [group.metric(group.http[rank] + 1, "afd_request_hold_seconds_sum") for rank in ranks],
    })


@pytest.mark.timeout(400)
@pytest.mark.parametrize("attention_ranks", [1, 2], ids=["1A1F", "2A1F"])
def test_with_no_hold_an_ffn_killed_mid_stream_fails_its_streams_and_comes_back(attention_ranks, checkpoints, processes):
    import httpx

    group = Group(checkpoints["deepseek_v2"], attention_ranks, processes, ffn_hold_s=0.0)
    ranks = range(attention_ranks)
    group.start_ffn()
    attention = [group.start_attention(rank) for rank in ranks]
    group.wait_healthy(ranks, 300)
    before = [group.greedy(rank) for rank in ranks]
    streams = [s for rank in ranks for s in start_streams(group, rank, 16 // attention_ranks)]

    killed_at = group.kill("ffn-0")
    for stream in streams:
        stream.join(60)
    cut = [s for s in streams if s.ended > killed_at]
    finished_before = [s for s in streams if s.ended <= killed_at]
    assert cut, "every stream finished before the kill: nothing was tested"
    for s in cut:  # an explicit error, never a short answer passed off as complete
        assert s.error and s.finish is None and len(s.times) < STREAM_TOKENS, (s.error, s.finish, len(s.times))
    assert all(s.finish == "length" and len(s.times) == STREAM_TOKENS for s in finished_before)
    last_end = max(s.ended for s in cut) - killed_at
    assert last_end <= 5.0, f"the last in-flight stream ended {last_end:.2f} s after the kill"
    assert not any(group.healthy(rank) for rank in ranks)
    down = httpx.post(f"{group.url(0)}/v1/completions", json={"model": group.model(0), **GREEDY}, timeout=30)
    assert down.status_code == 503

    group.start_ffn()
    recovered_in = group.wait_healthy(ranks, 90)
    assert recovered_in < 60
    assert [child.poll() for child in attention] == [None] * attention_ranks  # the same attention processes
    assert [group.greedy(rank) for rank in ranks] == before
    reconnects = [group.metric(group.http[rank] + 1, "afd_peer_reconnects_total") for rank in ranks]
    assert all(count >= 1 for count in reconnects)
    assert all("re-handshaking with ffn rank 0" in group.log(f"attn-{rank}") for rank in ranks)
    report(f"ffn_killed_no_hold_{attention_ranks}A1F", {
        "streams": len(streams), "cut": len(cut), "first_stream_end_s": round(min(s.ended for s in cut) - killed_at, 3),
        "last_stream_end_s": round(last_end, 3), "serving_again_after_ffn_start_s": round(recovered_in, 2),
        "serving_again_after_kill_s": round(time.monotonic() - killed_at, 2), "reconnects": reconnects,
        "reconnect_failures": [group.metric(group.http[rank] + 1, "afd_peer_reconnect_failures_total") for rank in ranks],
    })


def _rate(times: list[float], start: float, end: float) -> float:
    """Tokens per second of one stream between `start` and `end`."""
    return sum(start <= t < end for t in times) / max(end - start, 1e-9)


class FrontDoor:
    """`afd up`'s front door over the group's attention ranks, in this process (uvicorn on a thread)."""

    def __init__(self, group: Group):
        import uvicorn

        from afd.local.children import free_port_block
        from afd.server.front.door import Backends, FrontSettings, create_front_app

        app = create_front_app(Backends(lambda: [group.url(r) for r in range(len(group.http))]),
                               FrontSettings(resume_key=GROUP_SECRET.encode()))
        self.port = free_port_block(1)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.mark.timeout(500)
def test_attention_rank_killed_in_2a1f_the_other_keeps_serving_takes_its_streams_and_it_rejoins(checkpoints, processes):
    group = Group(checkpoints["deepseek_v2"], 2, processes, invariant=True)
    group.start_ffn()
    group.start_attention(0)
    group.start_attention(1)
    group.wait_healthy([0, 1], 300)
    before = [group.greedy(0), group.greedy(1)]
    front = FrontDoor(group)
    try:
        reference = start_streams(group, 0, 1)
        join_all(reference, 300)
        survivors = start_streams(group, 0, 4)
        moving = start_streams(group, 1, 4, url=front.url)  # through the front door: two on each rank
        time.sleep(1.0)

        killed_at = group.kill("attn-1")
        join_all(survivors + moving, 200)
        moves = group.metric_at(f"{front.url}/metrics", "afd_front_requests_moved_total")
    finally:
        front.close()
    for s in survivors + moving:  # every stream completes, whole, the moved ones under their own id
        assert s.error is None and s.finish == "length" and len(s.times) == STREAM_TOKENS, (s.error, s.finish, len(s.times))
        assert s.usage["completion_tokens"] == STREAM_TOKENS and len(s.ids) == 1
    assert moves >= 1, "no front-door stream was on the killed rank: nothing was moved"
    # Batch-invariant mode: the surviving rank's streams keep the undisturbed text whatever joined their steps, and a
    # moved stream's text up to the kill too. After the move its tokens come from a prompt pass over what it had (a
    # prompt attention kernel where the undisturbed run decoded), which rounds differently in bf16: that part is
    # reported, not asserted (tests/server/test_rank_loss.py asserts the whole text in float32 on CPU).
    expected = reference[0].text
    for index, s in enumerate(survivors):
        assert s.text == expected, f"surviving stream {index} {first_difference(s.text, expected)}"
    for index, s in enumerate(moving):
        before_kill = s.text_before(killed_at)
        assert before_kill and expected.startswith(before_kill), \
            f"moved stream {index} before the kill {first_difference(before_kill, expected)}"
    equal = sum(s.text == expected for s in moving)
    gaps = [b - a for s in survivors for a, b in zip(s.times, s.times[1:]) if b > killed_at - 0.5]
    stall = max(gaps, default=0.0)
    assert stall < 2.0, f"the surviving rank stalled {stall:.2f} s after the kill"
    ends = min(s.times[-1] for s in survivors)
    rate_before = sum(_rate(s.times, killed_at - 1.0, killed_at) for s in survivors)
    rate_after = sum(_rate(s.times, killed_at + 1.0, min(ends, killed_at + 3.0)) for s in survivors) if ends > killed_at + 1.5 else None
    assert group.processes.children["ffn-0"].poll() is None
    assert group.healthy(0)

    restarted_at = time.monotonic()
    group.start_attention(1)
    rejoined_in = group.wait_healthy([0, 1], 120)
    assert [group.greedy(0), group.greedy(1)] == before
    report("attention_killed_2A1F", {
        "surviving_streams": len(survivors), "max_token_gap_after_kill_s": round(stall, 3),
        "moved_streams": moves, "front_door_text_equal_undisturbed": f"{equal}/{len(moving)}",
        "front_door_longest_pause_s": round(max(max(b - a for a, b in zip(s.times, s.times[1:])) for s in moving), 2),
        "surviving_tokens_per_s_before": round(rate_before, 1),
        "surviving_tokens_per_s_after": None if rate_after is None else round(rate_after, 1),
        "restarted_rank_healthy_after_s": round(rejoined_in, 2),
        "ffn_log_drop": [line for line in group.log("ffn-0").splitlines() if "attn-1" in line and ("abort" in line or "dropping" in line)][-3:],
    })
    assert time.monotonic() - restarted_at < 120
