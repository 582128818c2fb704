"""spec.autoscaling's pure parts: the signals read from the ranks' series, and one decision."""

from __future__ import annotations

import pytest

from afd_operator.autoscaler.group_count import Groups, decide, initial_groups
from afd_operator.model.autoscaling import Autoscaling
from afd_operator.model.spec import SpecError, parse_spec
from afd_operator.autoscaler.signals import Load, ServiceSample, delta, load_of, parse_service, quantile

EXPOSITION = """\
# TYPE afd_time_to_first_token_seconds histogram
afd_time_to_first_token_seconds_bucket{le="0.1",rank="0",role="attention"} 2.0
afd_time_to_first_token_seconds_bucket{le="1.0",rank="0",role="attention"} 8.0
afd_time_to_first_token_seconds_bucket{le="+Inf",rank="0",role="attention"} 10.0
afd_time_to_first_token_seconds_bucket{le="0.1",rank="1",role="attention"} 0.0
afd_time_to_first_token_seconds_bucket{le="1.0",rank="1",role="attention"} 0.0
afd_time_to_first_token_seconds_bucket{le="+Inf",rank="1",role="attention"} 10.0
afd_time_to_first_token_seconds_count{rank="0",role="attention"} 10.0
afd_time_to_first_token_seconds_sum{rank="0",role="attention"} 3.0
# TYPE afd_requests_waiting gauge
afd_requests_waiting{rank="0",role="attention"} 3.0
afd_requests_waiting{rank="1",role="attention"} 1.0
# TYPE afd_requests_running gauge
afd_requests_running{rank="0",role="attention"} 5.0
afd_requests_running{rank="1",role="attention"} 4.0
# TYPE afd_kv_cache_usage_ratio gauge
afd_kv_cache_usage_ratio{rank="0",role="attention"} 0.2
afd_kv_cache_usage_ratio{rank="1",role="attention"} 0.6
# TYPE afd_step_duration_seconds histogram
afd_step_duration_seconds_bucket{le="+Inf",rank="0",role="ffn"} 7.0
"""


def test_parse_service_sums_the_ranks_histograms_and_gauges():
    sample = parse_service(EXPOSITION, 100.0)
    assert sample.ttft == ((0.1, 2.0), (1.0, 8.0), (float("inf"), 20.0))
    assert (sample.running, sample.waiting, sample.kv_usage, sample.in_flight) == (9.0, 4.0, (0.2, 0.6), 13.0)
    assert sample.itl == ()
    assert parse_service('afd_step_tokens_count{rank="0",role="ffn"} 3\n', 1.0) is None


def test_quantile_interpolates_inside_the_bucket_as_prometheus_does():
    buckets = ((0.1, 2.0), (1.0, 8.0), (float("inf"), 10.0))
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.9 * (5 - 2) / 6)
    assert quantile(0.9, buckets) == 1.0  # in +Inf: the highest finite bound
    assert quantile(0.9, ((1.0, 0.0), (float("inf"), 0.0))) is None


def test_delta_restarts_from_zero_after_a_counter_reset():
    assert delta(((1.0, 5.0), (float("inf"), 9.0)), ((1.0, 2.0), (float("inf"), 3.0))) == ((1.0, 3.0), (float("inf"), 6.0))
    assert delta(((1.0, 1.0), (float("inf"), 1.0)), ((1.0, 2.0), (float("inf"), 3.0))) == ((1.0, 1.0), (float("inf"), 1.0))


def test_load_of_two_groups_merges_histograms_and_averages_per_group():
    def sample(at, fast, slow, waiting):
        return ServiceSample(at, ((0.5, fast), (float("inf"), fast + slow)), (), 2.0, waiting, (0.5,))
    load = load_of({0: (sample(0, 0, 0, 0), sample(10, 9, 1, 4)), 1: (sample(0, 0, 0, 0), sample(10, 0, 10, 2))})
    assert load.groups == 2 and load.waiting_per_group == 3.0 and load.concurrency_per_group == 5.0
    assert load.ttft_p90 == 0.5  # 18 of 20 first tokens within 0.5 s → the 90th percentile is at 0.5 s
    assert load.in_flight == {0: 6.0, 1: 4.0}


def test_the_span_percentile_covers_every_scrape_kept_and_the_interval_only_the_last_two():
    def sample(at, fast, slow):
        return ServiceSample(at, ((0.5, fast), (2.0, fast + slow), (float("inf"), fast + slow)), (), 0.0, 0.0, ())
    load = load_of({0: [sample(0, 0, 0), sample(15, 100, 0), sample(30, 100, 5)]})
    assert load.ttft_p90 == pytest.approx(0.5 + 1.5 * 0.9)  # the last interval: 5 first tokens, all in (0.5, 2]
    assert load.ttft_p90_span == pytest.approx(0.5 * 94.5 / 100)  # the span: 100 fast, 5 slow
    with pytest.raises(ValueError, match="at least two scrapes"):
        load_of({0: [sample(0, 0, 0)]})


POLICY = Autoscaling(enabled=True, min_groups=1, max_groups=3, targets={"ttftP90Seconds": 1.0},
                     scale_up_window_seconds=60, scale_down_window_seconds=120, cooldown_seconds=30)


def load(at, ttft, groups=1, concurrency=4.0, waiting=0.0, kv=0.1):
    return Load(at, groups, ttft, 0.01, waiting, concurrency, kv)


def run(policy, loads, groups=Groups(1), start=None):
    status, out = dict(start or {}), []
    for item in loads:
        decision = decide(policy, item, status, groups, replicas=1, now=item.at)
        status = decision.status
        out.append(decision)
    return out


def test_up_only_after_the_target_is_missed_for_the_whole_window():
    decisions = run(POLICY, [load(t, 2.0) for t in (0, 15, 30, 45, 60)], Groups(1, shape="2A1F"))
    assert [d.desired for d in decisions] == [1, 1, 1, 1, 2]
    assert decisions[-1].status["saturationTopology"] == "2A1F"
    assert decisions[-1].event[1] == "AutoscaleUp" and "ttftP90Seconds 2 > target 1" in decisions[-1].event[2]
    assert decisions[-1].status["signal"] == "ttftP90Seconds"
    assert decisions[-1].status["saturationConcurrencyPerGroup"] == 4.0


def test_one_met_evaluation_restarts_the_window():
    decisions = run(POLICY, [load(0, 2.0), load(15, 2.0), load(30, 0.5), load(45, 2.0), load(90, 2.0), load(105, 2.0)])
    assert [d.desired for d in decisions] == [1, 1, 1, 1, 1, 2]


def test_proportional_signals_add_as_many_groups_as_needed_up_to_max():
    policy = POLICY.model_copy(update={"targets": POLICY.targets.model_copy(update={"waiting_per_group": 2.0})})
    decisions = run(policy, [load(t, 0.1, waiting=7.0) for t in (0, 60)])
    assert decisions[-1].desired == 3  # 7/2 → 4 groups wanted, maxGroups 3


def test_no_change_while_warming_and_no_removal_while_another_group_drains():
    loads = [load(t, 2.0) for t in (0, 15, 30, 45, 60)]
    warming = run(POLICY, loads, Groups(2, warming=1))
    assert [d.desired for d in warming] == [1] * 5 and warming[-1].status["missedSince"] is None
    assert warming[-1].status["reason"] == "holding: 1 group(s) warming up"
    assert run(POLICY, loads, Groups(1, draining=1))[-1].desired == 2  # a surge during a drain adds a group
    start = {"desiredGroups": 2}
    quiet = run(POLICY, [load(t, 0.2, groups=2, concurrency=1.0) for t in range(0, 300, 15)], Groups(2, draining=1), start)
    assert {d.desired for d in quiet} == {2} and quiet[-1].status["roomSince"] is None
    assert quiet[-1].status["reason"] == "every target met; 1 group(s) still draining"


def test_cooldown_after_a_change():
    start = {"desiredGroups": 2, "lastDecisionTime": "1970-01-01T00:00:50Z"}
    decisions = run(POLICY, [load(t, 2.0, groups=2) for t in (60, 75, 90, 105, 120, 135, 150)], Groups(2), start)
    assert decisions[0].status["reason"].startswith("holding: cool-down")
    assert [d.desired for d in decisions] == [2, 2, 2, 2, 2, 2, 3]  # the window opens at 90 (the first evaluation after the cool-down) and lasts 60 s


def test_down_only_when_the_load_fits_in_one_group_fewer_for_the_window():
    start = {"desiredGroups": 2}
    quiet = [load(t, 0.2, groups=2, concurrency=1.0) for t in range(0, 135, 15)]
    decisions = run(POLICY, quiet, Groups(2), start)
    assert [d.desired for d in decisions][-2:] == [2, 1]
    assert decisions[-1].event[1] == "AutoscaleDown" and "fits in 1 group(s)" in decisions[-1].event[2]


def test_down_is_refused_where_the_projected_load_passes_the_load_that_added_a_group():
    # a group was added at 4 requests per group: 2 groups x 3 requests would be 6 per group in one
    start = {"desiredGroups": 2, "saturationConcurrencyPerGroup": 4.0, "saturationTopology": "2A1F"}
    quiet = [load(t, 0.2, groups=2, concurrency=3.0) for t in range(0, 300, 15)]
    decisions = run(POLICY, quiet, Groups(2, shape="2A1F"), start)
    assert {d.desired for d in decisions} == {2}
    assert "concurrencyPerGroup would be 6" in decisions[-1].status["reason"]
    # spec.ratio has since made the groups 4A1F: what a 2A1F group carried says nothing of them
    reshaped = run(POLICY, quiet, Groups(2, shape="4A1F"), start)
    assert reshaped[-1].desired == 1 and reshaped[0].status["saturationConcurrencyPerGroup"] is None


def test_kv_use_is_projected_onto_the_remaining_groups():
    policy = POLICY.model_copy(update={"targets": POLICY.targets.model_copy(update={"kv_cache_usage": 0.8})})
    start = {"desiredGroups": 2}
    # 0.35 x 2 = 0.7 > 0.8 x 0.8 = 0.64: no room; 0.3 x 2 = 0.6: room
    assert {d.desired for d in run(policy, [load(t, 0.1, 2, 1.0, kv=0.35) for t in range(0, 300, 15)], Groups(2), start)} == {2}
    assert run(policy, [load(t, 0.1, 2, 1.0, kv=0.3) for t in range(0, 300, 15)], Groups(2), start)[-1].desired == 1


def test_a_resync_with_nothing_new_changes_nothing_in_the_status():
    """The operator writes status only when it changed: an evaluation without a new sample (a resync
    every 10 s, warming or cooling down or not) must give the same status.autoscaling."""
    first = decide(POLICY, load(10, 2.0), {}, Groups(1), 1, 10)
    for groups in (Groups(1), Groups(2, warming=1)):
        settled = decide(POLICY, load(10, 2.0), first.status, groups, 1, 20).status
        assert decide(POLICY, load(10, 2.0), settled, groups, 1, 30).status == settled
    cooling = {**first.status, "lastDecisionTime": "1970-01-01T00:00:05Z"}
    held = decide(POLICY, load(10, 2.0), cooling, Groups(1), 1, 20).status
    assert held["reason"] == "holding: cool-down until 1970-01-01T00:00:35Z"
    assert decide(POLICY, load(10, 2.0), held, Groups(1), 1, 25).status == held


def test_stale_samples_are_not_judged_twice():
    first = decide(POLICY, load(10, 2.0), {}, Groups(1), 1, 10)
    again = decide(POLICY, load(10, 2.0), first.status, Groups(1), 1, 200)
    assert again.status["missedSince"] == first.status["missedSince"] and again.desired == 1


def test_bounds_clamp_the_count_and_a_bounds_change_is_an_event():
    assert initial_groups(POLICY, {}, replicas=7) == 3
    decision = decide(POLICY, None, {"desiredGroups": 5}, Groups(5), 1, 0)
    assert decision.desired == 3 and decision.event[1] == "AutoscaleBounds"


@pytest.mark.parametrize("autoscaling, message", [
    ({"minGroups": 3, "maxGroups": 2}, "autoscaling.minGroups must not exceed autoscaling.maxGroups (3 > 2)"),
    ({"enabled": True}, "autoscaling.enabled needs at least one target"),
    ({"targets": {"kvCacheUsage": 2}}, "spec.autoscaling.targets.kvCacheUsage"),
])
def test_bad_autoscaling_specs_are_refused_by_name(autoscaling, message):
    with pytest.raises(SpecError) as err:
        parse_spec({"image": "x", "model": {"uri": "/m"}, "autoscaling": autoscaling})
    assert message in str(err.value)
