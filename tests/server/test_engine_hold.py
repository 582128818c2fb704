"""Hold and resume (issue 38): an engine whose FFN is lost keeps its requests, takes back the steps it launched
but did not read, and goes on once the link is back: the same tokens as an undisturbed run, no error, no token twice;
past its hold time the requests fail as before. Also requests carried over from another rank."""

import threading

import pytest

from afd.connector.base import PeerLost
from afd.engine.request import InvalidRequest, SamplingParams
from tests.server.conftest import submit_all
from tests.server.test_engine_link_wait import FakeLink, PROMPTS, make_engine, parts, tokens  # noqa: F401

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
PENALIZED = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5)


class StepLosingLink(FakeLink):
    """An FFN link lost inside a step (the CPU zmq case: the step's receive fails), not at its wait."""

    def __init__(self, events, fail_launch: int, down_checks: int = 0):
        super().__init__(events)
        self.fail_launch, self.down_checks = fail_launch, down_checks

    def recover(self) -> None:
        if self.down_checks > 0:  # the FFN rank is still restarting
            self.down_checks -= 1
            raise PeerLost("ffn rank 0 refused the connection")
        super().recover()


class FailingStep:
    def __init__(self, step, link):
        self.step, self.link, self.runner, self.kv_cache = step, link, step.runner, step.kv_cache

    def __call__(self, input_ids, layout):
        if self.step.launches + 1 == self.link.fail_launch:
            self.step.launches += 1
            self.link.fail_launch = None
            raise PeerLost("ffn rank 0 is gone: connection closed")
        return self.step(input_ids, layout)


def run(engine, params, start=True):
    outputs = submit_all(engine, [(prompt, params) for prompt in PROMPTS])
    if start:
        engine.start()
    return outputs.wait(30)


def reference(parts, params):  # noqa: F811
    engine = make_engine(parts)
    try:
        return tokens(run(engine, params))
    finally:
        engine.stop()


def no_errors(outputs):
    return all(o.error is None for outs in outputs for o in outs)


@pytest.mark.parametrize("params", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalized"])
def test_a_peer_lost_at_the_deferred_wait_is_held_and_every_stream_goes_on_unchanged(parts, params):  # noqa: F811
    events = []
    link = FakeLink(events, lose_at=4)  # steps 4 and 5 (launched on top of 4) are lost after sampling
    engine = make_engine(parts, link, events, link_check_s=0.05)
    engine.hold_s = 10.0
    try:
        held = run(engine, params)
        assert no_errors(held)
        assert link.recovered == 1 and engine.held_since is None
        assert engine.num_running == 0 and engine.kv_cache.usage == 0
    finally:
        engine.stop()
    assert tokens(held) == reference(parts, params)
    assert all(outs[-1].completion_tokens == 12 and outs[-1].finish_reason == "length" for outs in held)


def test_a_peer_lost_inside_a_step_waits_for_the_ffn_to_come_back_and_goes_on(parts):  # noqa: F811
    events = []
    link = StepLosingLink(events, fail_launch=3, down_checks=5)
    engine = make_engine(parts, link, events, link_check_s=0.05)
    engine.step = FailingStep(engine.step, link)
    engine.hold_s = 10.0
    try:
        held = run(engine, SEEDED)
        assert no_errors(held) and link.recovered == 1
    finally:
        engine.stop()
    assert tokens(held) == reference(parts, SEEDED)


def test_past_the_hold_time_the_held_requests_fail_with_the_error_of_today(parts):  # noqa: F811
    events = []
    link = StepLosingLink(events, fail_launch=3, down_checks=10_000)
    engine = make_engine(parts, link, events, link_check_s=0.05)
    engine.step = FailingStep(engine.step, link)
    engine.hold_s = 0.3
    try:
        failed = run(engine, GREEDY)
    finally:
        engine.stop()
    for outs in failed:
        assert outs[-1].finish_reason == "error" and "PeerLost" in outs[-1].error
        assert [len(o.token_ids) for o in outs[:-1]] == [1, 1]  # the tokens of steps 1 and 2, none twice


def _structured():
    from afd.server.api.structured import grammar_of

    return SamplingParams(max_tokens=12, temperature=0, grammar=grammar_of({"guided_regex": "q[a-z]{8,60}"})[0])


@pytest.mark.parametrize("params", [GREEDY, SEEDED, PENALIZED, "structured"],
                         ids=["greedy", "seeded", "penalized", "structured"])
def test_a_request_carried_over_with_its_first_tokens_goes_on_as_the_undisturbed_one(parts, params):  # noqa: F811
    params = _structured() if params == "structured" else params
    expected = reference(parts, params)
    engine = make_engine(parts).start()
    try:
        for prompt, full in zip(PROMPTS, expected):
            done = threading.Event()
            outs = []
            engine.submit(prompt, params, lambda o: (outs.append(o), o.finished and done.set()), carried=full[:5])
            assert done.wait(30)
            assert [t for o in outs for t in o.token_ids] == full[5:]  # nothing re-sent, nothing missing
            assert outs[-1].completion_tokens == 12 and outs[-1].prompt_tokens == len(prompt)
    finally:
        engine.stop()


def test_carried_tokens_that_leave_nothing_to_generate_are_refused(parts):  # noqa: F811
    engine = make_engine(parts)
    with pytest.raises(InvalidRequest, match="nothing to generate"):
        engine.submit([1, 2, 3], GREEDY, lambda o: None, carried=list(range(12)))


def test_a_structured_step_that_reads_the_previous_one_when_the_ffn_is_lost_is_taken_back_too(parts):  # noqa: F811
    params = _structured()
    expected = reference(parts, params)
    events = []
    link = FakeLink(events, lose_at=4)  # found while step 5's grammar masks wait for step 4's tokens
    engine = make_engine(parts, link, events, link_check_s=0.05)
    engine.hold_s = 10.0
    try:
        held = run(engine, params)
        assert no_errors(held) and link.recovered == 1
    finally:
        engine.stop()
    assert tokens(held) == expected
