"""On AFD the engine waits for a step on the FFN link only once the next step is launched, and a
peer loss found by that deferred wait fails the requests in flight, after which the engine serves again."""

import threading

import pytest
import torch

from afd.connector.base import PeerLost
from afd.engine.engine import Engine
from afd.engine.request import SamplingParams
from afd.engine.text.tokenizer import load_tokenizer
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic_runner import MonolithicRunner
from tests.server.conftest import submit_all

PROMPTS = [[5, 6, 7], [9, 8], [11, 12, 13, 14], [3, 4]]


class FakeLink:
    """An FFN link whose steps end when waited on; `lose_at` makes the wait for that step find the peer gone."""

    def __init__(self, events: list, lose_at: int | None = None):
        self.events, self.lose_at = events, lose_at
        self.ffn_draining = None
        self.recovered = 0
        self._marks = 0

    def end_step(self) -> int:
        self._marks += 1
        return self._marks

    def wait_step(self, mark=None) -> None:
        self.events.append(("wait", mark))
        if mark == self.lose_at:
            self.lose_at = None
            raise PeerLost("ffn rank 0 is gone: connection closed")

    def keepalive(self) -> None:
        pass

    def leave_if_done(self, idle: bool) -> bool:
        return False

    def recover(self) -> None:
        self.recovered += 1


class RecordingStep:
    """The CPU monolith as the step function, noting each launch."""

    def __init__(self, runner: MonolithicRunner, events: list):
        self.runner, self.events, self.kv_cache = runner, events, runner.kv_cache
        self.launches = 0

    def __call__(self, input_ids, layout):
        self.launches += 1
        self.events.append(("launch", self.launches))
        return self.runner(input_ids, layout)


@pytest.fixture(scope="module")
def parts(checkpoints):
    path = str(checkpoints["qwen3_moe"])
    return load_model(path), load_tokenizer(path)


def make_engine(parts, link=None, events=None, link_check_s=60.0):
    loaded, tokenizer = parts
    cache = KVCache.for_tokens(loaded.model.kv_layouts(), 2048, torch.float32, "cpu")
    step = RecordingStep(MonolithicRunner(loaded, cache), events if events is not None else [])
    return Engine(step, cache, tokenizer, (), max_num_seqs=8, max_model_len=128, link=link, link_check_s=link_check_s)


def generate(engine, prompts, max_tokens=6, timeout=30, start=False):
    """Submit every prompt (then `start` the engine, so they share the first step); each request's outputs."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = submit_all(engine, [(prompt, params) for prompt in prompts])
    if start:
        engine.start()
    return outputs.wait(timeout)


def tokens(outputs):
    return [[t for out in outs for t in out.token_ids] for outs in outputs]


def test_the_next_step_is_launched_before_the_link_wait_and_tokens_stay_the_same(parts):
    reference = make_engine(parts)
    try:
        expected = tokens(generate(reference, PROMPTS, start=True))
    finally:
        reference.stop()
    events = []
    engine = make_engine(parts, FakeLink(events), events)
    try:
        assert tokens(generate(engine, PROMPTS, start=True)) == expected
        assert engine.num_running == 0 and engine.kv_cache.usage == 0
    finally:
        engine.stop()
    launches = [n for kind, n in events if kind == "launch"]
    waits = [n for kind, n in events if kind == "wait"]
    assert launches == waits == list(range(1, len(launches) + 1))  # every step waited for once, in order
    assert len(launches) == 6  # one prefill step and five decode steps: the sixth token is sampled by step 6
    for step in launches[:-1]:  # step N+1 was built and launched while step N still ran
        assert events.index(("launch", step + 1)) < events.index(("wait", step))


def test_a_peer_lost_at_the_deferred_wait_fails_the_requests_in_flight_and_the_engine_serves_again(parts):
    events = []
    link = FakeLink(events, lose_at=3)
    engine = make_engine(parts, link, events, link_check_s=0.05)
    try:
        lost = generate(engine, PROMPTS, start=True)
        for outs in lost:  # tokens of steps 1 and 2, then an explicit error; nothing of the steps after
            assert [len(o.token_ids) for o in outs] == [1, 1, 0]
            assert outs[-1].finish_reason == "error" and "ffn rank 0 is gone" in outs[-1].error
        assert ("launch", 4) in events and ("wait", 4) not in events  # launched on top of step 3: dropped
        assert engine.num_running == 0 and engine.kv_cache.usage == 0
        for _ in range(200):  # the engine re-handshakes between steps
            if engine.error is None:
                break
            threading.Event().wait(0.01)
        assert engine.error is None and link.recovered == 1 and engine.reconnects == 1
        again = generate(engine, PROMPTS)
    finally:
        engine.stop()
    reference = make_engine(parts)
    try:
        assert tokens(again) == tokens(generate(reference, PROMPTS, start=True))
    finally:
        reference.stop()
    assert tokens(lost) == [t[:2] for t in tokens(again)]
