"""Adversarial edges of n choices sharing a prompt's prefill and blocks (issue 34) with hold and resume (issue 38):
aborts at every stage, a cache too small for every choice at once, fewer seats than choices, lost steps taken back
mid shared prefill and mid decode, choices ending at different steps, grammars. At every launch the block owners
are checked (each block free once or held by exactly its counted owners); at the end every block is back and the
surviving choices equal separate runs with the same parameters."""

import json
import random
import threading
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from afd.connector.base import PeerLost
from afd.engine.engine import Engine
from afd.engine.request import SamplingParams
from afd.engine.text.tokenizer import load_tokenizer
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic_runner import MonolithicRunner
from afd.server.api.structured import grammar_of
from afd.server.serve.serving_metrics import ServingMetrics
from tests.server.test_engine_link_wait import FakeLink

PROMPT = [(7 * i + 3) % 200 + 5 for i in range(40)]  # 2 full blocks and a partly filled third (block size 16)


@pytest.fixture(scope="module")
def parts(checkpoints):
    path = str(checkpoints["qwen3_moe"])
    return load_model(path), load_tokenizer(path)


class Probe:
    """The CPU monolith as the step: counts launches and tokens fed, runs `hooks[n]()` at launch n (before the step
    runs: an abort is then taken at the loop's next turn, while this step is unread), and checks the blocks of the
    running requests against the scheduler's counted owners at every launch (`violations`)."""

    def __init__(self, runner):
        self.runner, self.kv_cache = runner, runner.kv_cache
        self.engine, self.hooks, self.launches, self.fed, self.violations = None, {}, 0, 0, []

    @property
    def logit_rows(self):
        return self.runner.logit_rows

    @logit_rows.setter
    def logit_rows(self, rows):
        self.runner.logit_rows = rows

    @property
    def row_logits(self):
        return self.runner.row_logits

    def __call__(self, input_ids, layout):
        self.launches += 1
        self.fed += input_ids.numel()
        self.check_owners()
        hook = self.hooks.pop(self.launches, None)
        if hook is not None:
            hook()
        return self.runner(input_ids, layout)

    def check_owners(self):
        scheduler, cache = self.engine.scheduler, self.kv_cache
        held: dict[int, int] = {}
        for request in scheduler.running:
            for block in request.blocks:
                held[block] = held.get(block, 0) + 1
        free = cache.pool.free_ids()
        extra = scheduler.blocks._extra
        if len(set(free)) != len(free):
            self.violations.append(f"launch {self.launches}: a block is free twice")
        if set(free) & set(held):
            self.violations.append(f"launch {self.launches}: blocks free and held: {sorted(set(free) & set(held))}")
        wrong = {b: n for b, n in held.items() if n != 1 + extra.get(b, 0)}
        if wrong:
            self.violations.append(f"launch {self.launches}: owners != holders: {wrong}")
        if len(set(free) | set(held)) != cache.num_blocks:
            self.violations.append(f"launch {self.launches}: blocks lost")


def make(parts, tokens=1024, max_num_seqs=8, budget=8192, link=None, hold_s=0.0, max_model_len=256, eos=(),
         pipeline=True, pacer=0.0, observer=None, prefix_caching=False):
    loaded, tokenizer = parts
    cache = KVCache.for_tokens(loaded.model.kv_layouts(), tokens, torch.float32, "cpu")
    probe = Probe(MonolithicRunner(loaded, cache))
    engine = Engine(probe, cache, tokenizer, eos, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                    max_num_batched_tokens=budget, link=link, link_check_s=0.05, hold_s=hold_s, pipeline=pipeline,
                    prefill_itl_ratio=pacer, observer=observer, prefix_caching=prefix_caching)
    probe.engine = engine
    return engine, probe


class Collected:
    """Each request's outputs by index; `wait(indexes)` until those finished."""

    def __init__(self, count):
        self.lists = [[] for _ in range(count)]
        self.done = [threading.Event() for _ in range(count)]

    def collector(self, index):
        def on_output(out):
            self.lists[index].append(out)
            if out.finished:
                self.done[index].set()
        return on_output

    def wait(self, indexes, timeout=60):
        for index in indexes:
            assert self.done[index].wait(timeout), f"choice {index} never finished"
        return self.lists


def submit(engine, params_list, prompt=PROMPT, group="g"):
    outputs = Collected(len(params_list))
    with engine.together():
        for index, params in enumerate(params_list):
            engine.submit(prompt, params, outputs.collector(index), request_id=f"c{index}", group=group)
    return outputs


def settled(engine, probe, timeout=5.0):
    """Every block back, no shared owner, no leader left, nothing running or waiting; the owners were right at every
    launch."""
    cache, scheduler = engine.kv_cache, engine.scheduler
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (scheduler.running or scheduler.waiting
                                           or cache.free_blocks != cache.num_blocks):
        time.sleep(0.01)
    assert not scheduler.running and not scheduler.waiting
    assert cache.pool.free_ids() == list(range(cache.num_blocks))  # each block free exactly once
    assert not scheduler.blocks.shared and not scheduler.leaders
    assert probe.violations == []


def run_to_end(engine, probe, outputs, indexes):
    """Start `engine` on what was submitted, wait for `indexes` to finish and the engine to settle, stop it."""
    engine.start()
    try:
        results = outputs.wait(indexes)
        settled(engine, probe)
    finally:
        engine.stop()
    return results


def token_ids(outs):
    return [t for o in outs for t in o.token_ids]


def separate_outputs(parts, params_list, prompt=PROMPT):
    """Each parameter set's outputs as a request of its own (no group), in one engine."""
    engine, probe = make(parts)
    engine.start()
    try:
        outputs = submit(engine, params_list, prompt, group=None)
        results = outputs.wait(range(len(params_list)))
        settled(engine, probe)
    finally:
        engine.stop()
    assert all(o.error is None for outs in results for o in outs)
    return results


def separate(parts, params_list, prompt=PROMPT):
    """Each parameter set's tokens as a request of its own (no group), in one engine."""
    return [token_ids(outs) for outs in separate_outputs(parts, params_list, prompt)]


def seeded(n=4, max_tokens=6, **extra):
    return [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=31 + j, ignore_eos=True, **extra)
            for j in range(n)]


# -- aborts --------------------------------------------------------------------------------------------------------

# With a 16-token budget the 40-token prompt is fed in 3 chunks (launches 1-3); the choices board at launch 3.
ABORT_AT = {"queued": 0, "first_chunk": 1, "second_chunk": 2, "boarding": 3, "decoding": 5}


@pytest.mark.parametrize("at", list(ABORT_AT))
@pytest.mark.parametrize("who", ["leader", "rider", "all"])
@pytest.mark.parametrize("budget, pipeline", [(16, True), (16, False), (8192, True)],
                         ids=["chunked", "unpipelined", "one_chunk"])
def test_an_aborted_choice_frees_its_blocks_and_the_others_equal_separate_runs(parts, at, who, budget, pipeline):
    params = seeded()
    aborted = {"leader": [0], "rider": [2], "all": [0, 1, 2, 3]}[who]
    engine, probe = make(parts, budget=budget, pipeline=pipeline)
    outputs = submit(engine, params)
    abort = lambda: [engine.abort(f"c{i}") for i in aborted]  # noqa: E731
    if ABORT_AT[at]:
        probe.hooks[ABORT_AT[at]] = abort
    else:
        abort()  # taken with the submissions, before the first step
    engine.start()
    try:
        survivors = [i for i in range(len(params)) if i not in aborted]
        results = outputs.wait(survivors)
        if not survivors:  # nothing to wait for: wait for the aborts to be taken
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and engine.num_running + engine.num_waiting:
                time.sleep(0.01)
        settled(engine, probe)
    finally:
        engine.stop()
    assert all(o.error is None for i in survivors for o in results[i])
    expected = separate(parts, params)
    assert [token_ids(results[i]) for i in survivors] == [expected[i] for i in survivors]
    for i in aborted:  # an abort delivers nothing after it is taken: never a finished output
        assert not any(o.finished for o in results[i])


# (budget, launch at which the leader is aborted: 0 before the first step, None never); one chunk boards at launch 1
PROMPT_COUNT_CASES = {"chunked-never": (16, None), "chunked-queued": (16, 0), "chunked-first_chunk": (16, 1),
                      "chunked-boarding": (16, 3), "chunked-decoding": (16, 5), "one_chunk-never": (8192, None),
                      "one_chunk-boarding": (8192, 1), "one_chunk-boarding_unread": (8192, 2),
                      "one_chunk-decoding": (8192, 3)}


@pytest.mark.parametrize("budget, at", list(PROMPT_COUNT_CASES.values()), ids=list(PROMPT_COUNT_CASES))
def test_a_shared_prompt_is_counted_once_in_afd_prompt_tokens_whenever_its_leader_is_aborted(parts, budget, at):
    """afd_prompt_tokens counts the prompt the choices share once: at the leader's first token, or at the first
    rider's when the leader was aborted with the step that boards them unread (before: never counted)."""
    registry = CollectorRegistry()
    engine, probe = make(parts, budget=budget, observer=ServingMetrics(registry, rank=0))
    outputs = submit(engine, seeded())
    abort = lambda: engine.abort("c0")  # noqa: E731
    if at == 0:
        abort()
    elif at is not None:
        probe.hooks[at] = abort
    engine.start()
    try:
        outputs.wait([1, 2, 3])
        settled(engine, probe)
    finally:
        engine.stop()
    counted = registry.get_sample_value("afd_prompt_tokens_total", {"role": "attention", "rank": "0"})
    assert counted == len(PROMPT)


# -- a cache too small for every choice at once, fewer seats than choices ---------------------------------------------

@pytest.mark.parametrize("tokens, seats, lose_at", [(64, 8, None), (1024, 2, None), (80, 2, None), (48, 8, None),
                                                    (64, 8, 3), (64, 8, 9), (80, 2, 4), (48, 8, 12)])
def test_choices_that_cannot_all_run_at_once_wait_and_equal_separate_runs(parts, tokens, seats, lose_at):
    """64 tokens: the leader (3 blocks) and one rider (1 own block) fit; the others wait for room, then prefill on
    their own (and the fourth rides the third's prefill if it is still being fed). 48: one choice at a time. Some
    with a lost step taken back (hold and resume)."""
    params = seeded(**(PENALIZED if lose_at else {}))
    link = FakeLink([], lose_at=lose_at) if lose_at else None
    engine, probe = make(parts, tokens=tokens, max_num_seqs=seats, budget=16, link=link, hold_s=10.0 if link else 0)
    engine.start()
    try:
        outputs = submit(engine, params)
        results = outputs.wait(range(len(params)), timeout=60)
        settled(engine, probe)
    finally:
        engine.stop()
    assert all(o.error is None for outs in results for o in outs) and (link is None or link.recovered == 1)
    assert [token_ids(outs) for outs in results] == separate(parts, params)
    assert probe.fed < len(params) * len(PROMPT) + len(params) * 6 or tokens == 48  # some prompt was shared


# -- lost steps taken back (hold and resume) ---------------------------------------------------------------------------

PENALIZED = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)


@pytest.mark.parametrize("lose_at", [1, 2, 3, 4, 6])  # mid shared prefill, at the boarding step, mid decode
@pytest.mark.parametrize("controls", ["plain", "penalized"])
def test_a_lost_step_is_taken_back_and_every_choice_equals_separate_runs(parts, lose_at, controls):
    params = seeded(max_tokens=8, **(PENALIZED if controls == "penalized" else {}))
    link = FakeLink([], lose_at=lose_at)
    engine, probe = make(parts, budget=16, link=link, hold_s=10.0)
    engine.start()
    try:
        outputs = submit(engine, params)
        results = outputs.wait(range(len(params)))
        settled(engine, probe)
    finally:
        engine.stop()
    assert all(o.error is None for outs in results for o in outs) and link.recovered == 1
    assert [token_ids(outs) for outs in results] == separate(parts, params)
    assert all(len(token_ids(outs)) == 8 for outs in results)  # no token twice, none missing


@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_a_lost_step_of_an_aborted_choice_leaves_no_count_on_the_choice_that_took_its_controls_slot(parts, temperature):
    """Three penalized choices, two seats: the leader is aborted while its decode step (launch 2) is unread; the
    third choice takes its seat and, in launch 3, its controls slot; then launch 2 is lost. Taking it back must not
    lower the counts of the slot's new owner (its frequency penalty would turn into a bonus)."""
    params = [SamplingParams(max_tokens=8, temperature=temperature, seed=41 + j, ignore_eos=True,
                             frequency_penalty=2.0, presence_penalty=0.5) for j in range(3)]
    link = FakeLink([], lose_at=2)
    engine, probe = make(parts, max_num_seqs=2, link=link, hold_s=10.0)
    probe.hooks[2] = lambda: engine.abort("c0")
    engine.start()
    try:
        outputs = submit(engine, params)
        results = outputs.wait([1, 2])
        settled(engine, probe)
    finally:
        engine.stop()
    assert link.recovered == 1 and all(o.error is None for i in (1, 2) for o in results[i])
    expected = separate(parts, params)
    assert [token_ids(results[i]) for i in (1, 2)] == expected[1:]


def prompt_entries(outs):
    """The first output's prompt logprobs as (token, logprob to 4 places) pairs (None first)."""
    first = outs[0].prompt_logprobs
    return [None if e is None else (e.token_id, round(e.logprob, 4)) for e in first]


@pytest.mark.parametrize("busy", [False, True], ids=["alone", "beside_another_group"])
def test_choices_taken_back_to_wait_for_a_leader_aborted_meanwhile_share_one_prefill_again(parts, busy):
    """The leader is aborted while the step that boards its riders (launch 3, its last chunk) is unread, and that
    step is lost: taken back, the riders wait for a prefill again, from a leader that has ended. They must not each
    prefill into the one prompt-logprob list, nor wait for a leader that never comes (beside another group's
    choices, which keep the scheduler's set of leaders non-empty)."""
    params = seeded(n=3, prompt_logprobs=1)
    boarding = 4 if busy else 3  # beside the other group's prefill and decodes the prompt takes 4 chunks
    link = FakeLink([], lose_at=boarding)
    engine, probe = make(parts, budget=16, link=link, hold_s=10.0)
    probe.hooks[boarding] = lambda: engine.abort("c0")
    other = Collected(3)
    if busy:  # another request's choices, riding a leader through the whole test
        with engine.together():
            for index in range(3):
                engine.submit(list(range(60, 70)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                              other.collector(index), request_id=f"h{index}", group="h")
    outputs = submit(engine, params)
    engine.start()
    try:
        results = outputs.wait([1, 2])
        other_tokens = len(token_ids(other.lists[0]))
        other.wait(range(3) if busy else [])
        settled(engine, probe)
    finally:
        engine.stop()
    assert link.recovered == 1 and all(o.error is None for i in (1, 2) for o in results[i])
    alone = separate_outputs(parts, params[1:])
    assert [token_ids(results[i]) for i in (1, 2)] == [token_ids(outs) for outs in alone]
    assert [prompt_entries(results[i]) for i in (1, 2)] == [prompt_entries(outs) for outs in alone]
    if busy:  # they went on at once, not after the other group's choices
        assert other_tokens < 20


def outcome(outs):
    """(tokens, text, finish reason) of one request."""
    return token_ids(outs), "".join(o.text for o in outs), outs[-1].finish_reason


def run_choices(parts, params, lose_at=None, seats=8, budget=16, group="g", eos=()):
    link = FakeLink([], lose_at=lose_at) if lose_at else None
    engine, probe = make(parts, budget=budget, max_num_seqs=seats, link=link, hold_s=10.0 if link else 0.0, eos=eos)
    engine.start()
    try:
        results = submit(engine, params, group=group).wait(range(len(params)))
        settled(engine, probe)
    finally:
        engine.stop()
    assert all(o.error is None for outs in results for o in outs)
    assert link is None or link.recovered == 1
    return [outcome(outs) for outs in results]


@pytest.mark.parametrize("lose_at, seats", [(None, 8), (5, 8), (3, 8), (None, 2), (4, 2)])
def test_choices_ending_at_different_steps_each_equal_their_separate_run(parts, lose_at, seats):
    """max_tokens, a stop token, a stop string and min_tokens holding a stop token back, one per choice: each ends
    at its own step (some while the others decode on, some inside the pipelined loop's extra step)."""
    free = [SamplingParams(max_tokens=10, temperature=1.0, seed=51 + j, ignore_eos=True) for j in range(4)]
    texts = run_choices(parts, free, group=None)
    stop_text = texts[2][1][4:6]  # two characters of the third choice's text: it stops there
    assert stop_text.strip()
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, seed=51, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.0, seed=52, ignore_eos=True, stop_token_ids=(texts[1][0][2],)),
        SamplingParams(max_tokens=10, temperature=1.0, seed=53, ignore_eos=True, stop=(stop_text,)),
        SamplingParams(max_tokens=10, temperature=1.0, seed=54, ignore_eos=True, min_tokens=4,
                       stop_token_ids=(texts[3][0][1],)),
    ]
    shared = run_choices(parts, params, lose_at=lose_at, seats=seats)
    assert shared == run_choices(parts, params, group=None)
    assert [len(tokens) for tokens, _, _ in shared][:2] == [3, 3] and shared[0][2] == "length"
    assert shared[1][2] == shared[2][2] == "stop" and stop_text not in shared[2][1]
    assert len(shared[3][0]) >= 4 and texts[3][0][1] not in shared[3][0][:3]


SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["ab", "cd", "ef", "gh"]}, "ok": {"type": "boolean"}},
          "required": ["kind", "ok"], "additionalProperties": False}


def schema_grammar():
    return grammar_of({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}})[0]


@pytest.mark.parametrize("lose_at", [None, 3, 6])
def test_structured_choices_follow_their_grammar_each_and_equal_separate_runs(parts, lose_at):
    """json_schema choices (llguidance matchers of their own, masks on their leader's row at boarding), ended by the
    grammar's EOS: each parses, validates and equals its separate run, a lost step taken back or not."""
    grammar = schema_grammar()
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=61 + j, grammar=grammar) for j in range(4)]
    eos = (parts[1].eos_token_id,)
    shared = run_choices(parts, params, lose_at=lose_at, eos=eos)
    assert shared == run_choices(parts, params, group=None, eos=eos)
    assert len({text for _, text, _ in shared}) > 1
    for _, text, reason in shared:
        assert reason == "stop"
        value = json.loads(text)
        assert set(value) == {"kind", "ok"} and value["kind"] in SCHEMA["properties"]["kind"]["enum"]
        assert isinstance(value["ok"], bool)


@pytest.mark.parametrize("lose_at", [2, 3])
@pytest.mark.parametrize("at", ["first_chunk", "second_chunk"])
def test_prompt_logprobs_of_choices_handed_over_or_taken_back_equal_separate_runs(parts, at, lose_at):
    """The leader aborted mid prefill (its riders handed to the first of them), then a lost step: every surviving
    choice's prompt logprobs and tokens equal its own run's."""
    params = seeded(n=3, prompt_logprobs=2)
    link = FakeLink([], lose_at=lose_at)
    engine, probe = make(parts, budget=16, link=link, hold_s=10.0)
    probe.hooks[ABORT_AT[at]] = lambda: engine.abort("c0")
    outputs = submit(engine, params)
    results = run_to_end(engine, probe, outputs, [1, 2])
    assert all(o.error is None for i in (1, 2) for o in results[i])
    alone = separate_outputs(parts, params[1:])
    assert [token_ids(results[i]) for i in (1, 2)] == [token_ids(outs) for outs in alone]
    assert [prompt_entries(results[i]) for i in (1, 2)] == [prompt_entries(outs) for outs in alone]
    assert len(prompt_entries(results[1])) == len(PROMPT)


class DownLink(FakeLink):
    """An FFN link whose re-handshake fails `down_checks` times (the FFN rank restarting) before it is back."""

    def __init__(self, down_checks: int):
        super().__init__([])
        self.down_checks = down_checks

    def recover(self) -> None:
        if self.down_checks > 0:
            self.down_checks -= 1
            raise PeerLost("ffn rank 0 refused the connection")
        super().recover()


def lost():
    raise PeerLost("ffn rank 0 is gone: connection closed")


@pytest.mark.parametrize("at", ["first_chunk", "boarding", "decoding"])
def test_choices_held_past_the_hold_time_all_fail_and_give_every_block_back(parts, at):
    params = seeded(n=3)
    engine, probe = make(parts, budget=16, link=DownLink(10_000), hold_s=0.3)
    probe.hooks[ABORT_AT[at]] = lost
    engine.start()
    try:
        results = submit(engine, params).wait(range(3))
        settled(engine, probe)
    finally:
        engine.stop()
    for outs in results:
        assert outs[-1].finish_reason == "error" and "PeerLost" in outs[-1].error
        assert sum(o.finished for o in outs) == 1


@pytest.mark.parametrize("who", ["leader", "rider"])
@pytest.mark.parametrize("at", ["first_chunk", "second_chunk", "boarding", "decoding"])
def test_a_choice_aborted_while_the_choices_are_held_frees_its_blocks_and_the_rest_go_on_unchanged(parts, at, who):
    """The FFN is lost inside a launch (the step taken back) and stays away for a few link checks; meanwhile a
    choice is aborted (taken while the others are held). Once it is back the others equal separate runs."""
    params = seeded(n=3, **PENALIZED)
    victim = {"leader": 0, "rider": 1}[who]
    link = DownLink(4)
    engine, probe = make(parts, budget=16, link=link, hold_s=10.0)

    def abort_and_lose():
        engine.abort(f"c{victim}")
        lost()

    probe.hooks[ABORT_AT[at]] = abort_and_lose
    outputs = submit(engine, params)
    engine.start()
    try:
        survivors = [i for i in range(3) if i != victim]
        results = outputs.wait(survivors)
        settled(engine, probe)
    finally:
        engine.stop()
    assert link.recovered == 1 and all(o.error is None for i in survivors for o in results[i])
    expected = separate(parts, params)
    assert [token_ids(results[i]) for i in survivors] == [expected[i] for i in survivors]


@pytest.mark.parametrize("after", [1, 2, 4])
@pytest.mark.parametrize("lose_at", [None, 5])
def test_choices_aborted_from_the_output_thread_as_a_client_leaves_free_every_block(parts, after, lose_at):
    """A client drops choices 0 and 2 when choice 1 has `after` tokens (the abort comes from the output thread, at
    any point of the pipelined loop); choices 1 and 3 go on unchanged, and every block comes back."""
    params = seeded(max_tokens=8, **PENALIZED)
    link = FakeLink([], lose_at=lose_at) if lose_at else None
    engine, probe = make(parts, budget=16, link=link, hold_s=10.0 if link else 0.0)
    outputs = Collected(len(params))
    seen = []

    def watch(out):
        seen.extend(out.token_ids)
        if len(seen) == after:
            engine.abort("c0")
            engine.abort("c2")
        outputs.collector(1)(out)

    with engine.together():
        for index, sampling in enumerate(params):
            on_output = watch if index == 1 else outputs.collector(index)
            engine.submit(PROMPT, sampling, on_output, request_id=f"c{index}", group="g")
    results = run_to_end(engine, probe, outputs, [1, 3])
    expected = separate(parts, params)
    assert [token_ids(results[i]) for i in (1, 3)] == [expected[1], expected[3]]
    for i in (0, 2):  # cut short, never finished, what came out is a prefix of its separate run
        assert not any(o.finished for o in results[i]) and token_ids(results[i]) == expected[i][:len(token_ids(results[i]))]


def test_choices_cut_by_the_context_length_end_together_and_equal_separate_runs(parts):
    """A 40-token prompt in a 44-token context: every choice ends by length after 4 tokens, whatever its max_tokens
    (the riders' own blocks are what the context leaves them)."""
    params = [SamplingParams(max_tokens=4 + 3 * j, temperature=1.0, seed=71 + j, ignore_eos=True) for j in range(3)]

    def run(group):
        engine, probe = make(parts, budget=16, max_model_len=44)
        engine.start()
        try:
            results = submit(engine, params, group=group).wait(range(3))
            settled(engine, probe)
        finally:
            engine.stop()
        return [outcome(outs) for outs in results]

    shared = run("g")
    assert shared == run(None)
    assert [(len(tokens), reason) for tokens, _, reason in shared] == [(4, "length")] * 3


@pytest.mark.parametrize("at", ["second_chunk", "boarding", "decoding"])
def test_stopping_the_engine_ends_every_choice_with_an_error_and_frees_every_block(parts, at):
    params = seeded(n=3)
    engine, probe = make(parts, budget=16)
    stopping = threading.Event()
    probe.hooks[ABORT_AT[at]] = stopping.set
    outputs = submit(engine, params)
    engine.start()
    assert stopping.wait(30)
    engine.stop()
    results = outputs.wait(range(3), timeout=10)
    for outs in results:
        assert outs[-1].finish_reason == "error" and sum(o.finished for o in outs) == 1
    assert engine.kv_cache.pool.free_ids() == list(range(engine.kv_cache.num_blocks))
    assert not engine.scheduler.blocks.shared and not engine.scheduler.leaders and not engine.scheduler.running


@pytest.mark.parametrize("seed", range(40))
def test_random_mixes_of_seats_room_aborts_and_a_lost_step_leave_the_survivors_unchanged(parts, seed):
    """Seeded random scenarios: 2-5 choices of a prompt of 17-50 tokens with their own max_tokens and controls, a
    budget, seats, cache room and a prefill pacer (or none) drawn at random, some choices aborted at random launches, maybe a step lost at its
    wait or inside it (the FFN then away for a few link checks)."""
    draw = random.Random(seed)
    n = draw.randint(2, 5)
    prompt = PROMPT[:draw.choice([17, 32, 40])] + PROMPT[:draw.choice([0, 10])]
    extra = draw.choice([{}, PENALIZED, {"min_tokens": 2}, {"logprobs": 1}, {"prompt_logprobs": 1}, "grammar"])
    eos = (parts[1].eos_token_id,) if extra == "grammar" else ()
    extra = {"grammar": schema_grammar(), "ignore_eos": False} if extra == "grammar" else {"ignore_eos": True, **extra}
    params = [SamplingParams(max_tokens=draw.randint(2, 8), temperature=draw.choice([0.0, 1.0]), seed=80 + j,
                             **extra) for j in range(n)]
    budget, seats, tokens = draw.choice([16, 24, 8192]), draw.choice([1, 2, 3, 8]), draw.choice([64, 96, 1024])
    aborted = sorted(draw.sample(range(n), draw.randint(0, n - 1)))
    loss = draw.choice([None, "wait", "inside"])
    link = {None: None, "wait": FakeLink([], lose_at=draw.randint(1, 8)), "inside": DownLink(draw.randint(0, 3))}[loss]
    engine, probe = make(parts, tokens=tokens, max_num_seqs=seats, budget=budget, link=link,
                         hold_s=10.0 if link else 0.0, pacer=draw.choice([0.0, 0.0, 1.5]), eos=eos)
    hooks: dict[int, list] = {}
    for index in aborted:
        hooks.setdefault(draw.randint(1, 8), []).append(lambda i=index: engine.abort(f"c{i}"))
    if loss == "inside":
        hooks.setdefault(draw.randint(1, 8), []).append(lost)
    for at, calls in hooks.items():
        probe.hooks[at] = lambda calls=calls: [call() for call in calls]
    outputs = submit(engine, params, prompt)
    engine.start()
    survivors = [i for i in range(n) if i not in aborted]
    try:
        results = outputs.wait(survivors)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and engine.num_running + engine.num_waiting:
            time.sleep(0.01)  # aborts of choices that never reach their launch are taken at the end
        for index in aborted:
            engine.abort(f"c{index}")
        settled(engine, probe)
    finally:
        engine.stop()
    assert all(o.error is None for i in survivors for o in results[i])
    engine_alone, probe_alone = make(parts, eos=eos)
    engine_alone.start()
    try:
        alone = submit(engine_alone, params, prompt, group=None).wait(range(n))
    finally:
        engine_alone.stop()
    assert [token_ids(results[i]) for i in survivors] == [token_ids(alone[i]) for i in survivors]
    if "prompt_logprobs" in extra:
        assert [prompt_entries(results[i]) for i in survivors] == [prompt_entries(alone[i]) for i in survivors]
    for i in aborted:
        got = token_ids(results[i])
        assert got == token_ids(alone[i])[:len(got)]
