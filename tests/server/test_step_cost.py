"""The step-time model learns the engine's step cost from noisy steps, and the pacer turns it into a prefill cap."""

import math
import random

import pytest

from afd.engine.scheduling.step_cost import MIN_PREFILL_TOKENS, PrefillPacer, StepClock, StepCostModel, deadline_floor


def line(tokens, base=0.010, per_token=10e-6):
    return base + per_token * tokens


def learned(seed=0, steps=600, outliers=0.05, fn=line):
    """A model fed `steps` steps of random sizes whose times follow `fn` with ±5 % noise and some 10× stalls."""
    rng, model = random.Random(seed), StepCostModel()
    for _ in range(steps):
        tokens = rng.choice([rng.randint(8, 80), rng.randint(16, 4096)])  # many decode-sized steps, fewer large ones
        seconds = fn(tokens) * rng.uniform(0.95, 1.05) * (10 if rng.random() < outliers else 1)
        model.observe(tokens, seconds)
    return model


@pytest.mark.parametrize("tokens", [16, 64, 300, 1000, 2048, 4000])
def test_a_known_line_is_learned_from_noisy_steps_with_stalls(tokens):
    model = learned()
    assert model.predict(tokens) == pytest.approx(line(tokens), rel=0.06)
    assert model.tokens_within(line(tokens)) == pytest.approx(tokens, rel=0.15, abs=12)


def test_a_curve_that_is_flat_then_rises_is_followed_where_one_straight_line_is_not():
    def launch_bound(tokens):  # the device idles under 512 tokens, then pays per token
        return 0.020 + 40e-6 * max(0, tokens - 512)

    model = learned(fn=launch_bound)
    assert model.predict(64) == pytest.approx(0.020, rel=0.05)
    assert model.predict(2048) == pytest.approx(launch_bound(2048), rel=0.08)
    assert model.tokens_within(0.040) == pytest.approx(1012, rel=0.1)  # 2 × the decode step: 500 tokens past the knee



def one_curve(itl_ratio: float, model: StepCostModel) -> PrefillPacer:
    """A pacer whose decode-only and prompt steps share `model` (the engine learns one curve of each)."""
    return PrefillPacer(itl_ratio, cost=model, decode_cost=model)

def test_steps_of_one_size_predict_nothing():
    model = StepCostModel()
    assert model.predict(64) is None and model.tokens_within(1.0) is None
    for _ in range(10):
        model.observe(64, 0.01)  # one bucket, however full: no slope
    assert model.predict(64) is None and one_curve(2.0, model).prefill_cap(64) == MIN_PREFILL_TOKENS


def test_while_learning_one_step_of_a_second_size_gives_a_curve_and_full_buckets_then_outvote_it():
    model = StepCostModel()
    model.observe(2048, 0.050)  # a run's first prompt step
    model.observe(100, 0.014)  # the first capped step beside decodes
    assert model.predict(100) == pytest.approx(0.014) and model.predict(2048) == pytest.approx(0.050)
    assert one_curve(2.0, model).prefill_cap(8, backlog=[(9000, 0)]) > 400  # no longer the floor (141) alone
    model.observe(2048, 0.500)  # a stall, while that bucket holds too few steps to outvote it
    for _ in range(2):
        model.observe(100, 0.014)
        model.observe(400, 0.020)
    assert model.predict(2048) == pytest.approx((0.050 + 0.500) / 2)  # one full bucket (100): every bucket counts
    model.observe(400, 0.020)  # two full buckets: the line through them, the 2048 bucket's two steps no longer count
    assert model.predict(400) == pytest.approx(0.020) and model.predict(2048) == pytest.approx(0.020 + 1648 * 0.006 / 300)


def test_the_curve_never_falls_with_more_tokens_and_a_noisy_bucket_of_few_steps_weighs_little():
    model = StepCostModel()
    for tokens, seconds in [(8, 0.05)] * 3 + [(64, 0.02)] * 9 + [(256, 0.015)] * 3 + [(1024, 0.03)] * 3:
        model.observe(tokens, seconds)  # a slow bucket of 3 steps (a busy host), a cheap one (noise)
    assert [s for _, s in model.curve()] == pytest.approx([0.025, 0.025, 0.025, 0.03])  # (3·50 + 9·20 + 3·15) / 15 ms
    assert model.predict(64) == pytest.approx(0.025) and model.tokens_within(0.0275) == pytest.approx(640)


def test_old_steps_stop_counting():
    model = StepCostModel(horizon=100)
    for _ in range(3):
        model.observe(2048, 0.5)
    for _ in range(100):
        model.observe(64, 0.02)
        model.observe(128, 0.03)
    assert model.predict(2048) == pytest.approx(0.03 + 1920 * 0.01 / 64)  # the line of the recent steps only


def test_the_cap_keeps_a_predicted_mixed_step_within_the_ratio():
    pacer = one_curve(2.0, learned())
    cap = pacer.prefill_cap(64)
    assert cap == pytest.approx(532, rel=0.1)  # (0.75 × 2 × (10 ms + 64 × 10 µs) − 10 ms) / 10 µs − 64
    assert line(64 + cap) <= 2.0 * line(64) * 1.1
    assert pacer.last_cap == cap


def test_the_cap_never_goes_below_the_minimum_chunk():
    pacer = one_curve(1.0, learned())
    assert pacer.prefill_cap(64) == MIN_PREFILL_TOKENS


def test_no_cap_without_decodes_and_only_the_floors_before_the_cost_is_learned():
    assert one_curve(2.0, learned()).prefill_cap(0) is None
    assert PrefillPacer(2.0).prefill_cap(0, backlog=[(50000, 0)]) is None
    unlearned = PrefillPacer(2.0, backlog_steps=64)
    assert unlearned.prefill_cap(64) == MIN_PREFILL_TOKENS
    assert unlearned.prefill_cap(64, backlog=[(36000, 0)]) == 563  # a run's first prompts: 1/64 of them a step


def test_a_cap_beyond_any_cost_is_no_cap():
    model = StepCostModel()
    for tokens in (64, 128) * 3:
        model.observe(tokens, 0.01)  # step time flat as far as measured
    assert model.tokens_within(0.02) == math.inf and one_curve(2.0, model).prefill_cap(64) is None


def test_a_ratio_below_one_leaves_prompts_the_minimum_chunk():
    assert one_curve(0.5, learned()).prefill_cap(64) == MIN_PREFILL_TOKENS


def test_the_clock_of_synchronous_steps_is_each_launch():
    """CPU: a step runs inside its launch; its drain, after the next launch, finds it done."""
    clock, t, seconds = StepClock(), 0.0, []
    durations = [0.010, 0.030, 0.010]
    launches = []
    for d in durations:
        launches.append((t, t + d))
        t += d + 0.001  # host work between launches
    for (started, launched), (next_started, next_launched) in zip(launches, launches[1:] + [(t, t)]):
        seconds.append(clock.done(started, launched, next_launched, next_launched + 1e-5))
    assert seconds == pytest.approx(durations)


def test_the_clock_of_asynchronous_steps_is_the_time_between_results():
    """GPU: launches return at once; the device runs the steps back to back and each drain blocks."""
    clock, durations = StepClock(), [0.010, 0.030, 0.010]
    device_free, seconds, started = 0.0, [], 0.0
    ready_times = []
    for d in durations:
        device_free = max(device_free, started) + d
        ready_times.append((started, device_free))
        started += 0.001  # the host launches the next step a millisecond later
    for started, ready in ready_times:
        seconds.append(clock.done(started, started + 1e-4, max(started + 0.002, ready - 0.005), ready))
    assert seconds == pytest.approx(durations)


def test_a_backlog_raises_the_cap_to_a_share_of_it():
    model = learned()
    pacer = PrefillPacer(2.0, cost=model, decode_cost=model, backlog_steps=16)
    assert pacer.prefill_cap(64, backlog=[(8000, 0)]) == pacer.prefill_cap(64)  # 500 a step: the ratio allows more
    assert pacer.prefill_cap(64, backlog=[(32000, 0)]) == 2000  # prompts arrive faster than the ratio lets them in
    patient = one_curve(2.0, learned())  # the default: 64 steps (AFD_PREFILL_BACKLOG_STEPS)
    assert patient.prefill_cap(64, backlog=[(32000, 0)]) == pacer.prefill_cap(64)  # 500 a step: the ratio's cap holds
    assert patient.prefill_cap(64, backlog=[(256000, 0)]) == 4000


def test_the_floor_meets_every_prompts_deadline_instead_of_decaying_with_the_backlog():
    """Each prompt is in within `backlog_steps` steps of being queued: the floor is the rate the most pressed one needs."""
    assert deadline_floor([(1600, 0)] * 4, 16) == 400  # a burst: its last prompt is due in 16 steps
    assert deadline_floor([(100, 14), (160, 0)], 16) == 50  # an old prompt's rest is due in 2 steps
    assert deadline_floor([(100, 15), (160, 0)], 16) == 100  # due now
    assert deadline_floor([(100, 20), (160, 0)], 16) == 100  # overdue: all of it now
    left, steps = [1600] * 4, 0  # a burst drained at the floor: done in 16 steps (1/16 of what is left: 48 steps)
    while sum(left):
        take = deadline_floor([(tokens, steps) for tokens in left if tokens], 16)
        for i, tokens in enumerate(left):
            left[i], take = tokens - min(tokens, take), take - min(tokens, take)
        steps += 1
    assert steps == 16




def test_decode_only_steps_and_steps_with_prompt_tokens_are_learned_apart():
    """A decode-only step replays a graph (7 ms at batch 1); any step with prompt tokens costs 14 ms and more:
    one curve through both would slope from one kind to the other."""
    pacer = PrefillPacer(2.0)
    for _ in range(3):
        for batch, seconds in ((1, 0.007), (16, 0.0125), (64, 0.016)):
            pacer.observe(batch, seconds, prompt=False)
        for tokens in (150, 600, 2048):
            pacer.observe(tokens, 0.014 + 13e-6 * tokens)
    assert pacer.decode_cost.predict(16) == pytest.approx(0.0125) and pacer.cost.predict(600) == pytest.approx(0.0218)
    assert pacer.prefill_cap(3, [(600, 0)] * 13) is None  # no chunk fits 0.75 × 2 × 7 ms beside 3 decodes: the burst goes in
    assert pacer.prefill_cap(3, [(600, 0)]) == MIN_PREFILL_TOKENS  # one prompt beside 3 decodes: the floors
    assert pacer.prefill_cap(64, [(600, 0)] * 13) == pytest.approx(705, abs=2)  # 0.75 × 2 × 16 ms: 769 tokens, 64 decodes
