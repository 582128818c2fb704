"""spec.autoscaling simulated on a recorded trace (tests/operator/traces/, bench/cluster/record_slo_trace.py):
a surge scales up within the window, a flapping load does not flap, a drop scales down after
the window, the bounds hold."""

from __future__ import annotations

import statistics

import pytest

from afd_operator.model.autoscaling import Autoscaling
from afd_operator.autoscaler.signals import load_of
from autoscale_sim import RecordedLevels, simulate, square, steps

TICK = 15.0
UP_WINDOW, DOWN_WINDOW, COOLDOWN, WARMUP = 60, 120, 60, 45


@pytest.fixture(scope="module")
def levels():
    return RecordedLevels()


@pytest.fixture(scope="module")
def target(levels):
    """A TTFT p90 target between what the recorded group gives at 2 and at 8 streams."""
    def median_p90(streams):
        return statistics.median(load_of({0: pair}).ttft_p90 for pair in levels.pairs[streams])
    light, heavy = median_p90(2), median_p90(8)
    assert heavy > 1.5 * light, f"the trace must tell the loads apart (p90 {light:.3f} s vs {heavy:.3f} s)"
    return (light + heavy) / 2


def policy(target, **extra):
    return Autoscaling(enabled=True, targets={"ttftP90Seconds": target}, scale_up_window_seconds=UP_WINDOW,
                       scale_down_window_seconds=DOWN_WINDOW, cooldown_seconds=COOLDOWN, **extra)


def reversals(run):
    signs = [d > 0 for _, d in run.changes()]
    return sum(a != b for a, b in zip(signs, signs[1:]))


def test_a_surge_scales_up_within_the_window_and_settles(levels, target):
    surge_at = 300
    run = simulate(policy(target, max_groups=4), steps((surge_at, 2), (3600, 6)), 1800, levels, warmup_s=WARMUP)
    changes = run.changes()
    assert changes and all(d > 0 for _, d in changes), changes
    first = changes[0][0]
    assert surge_at < first <= surge_at + UP_WINDOW + TICK, run.events  # (a light-load spike may open the window)
    assert run.groups_at(surge_at - 1) == 1
    assert 2 <= run.groups_at(1800) <= 4
    assert run.events[0][1] == "AutoscaleUp" and "ttftP90Seconds" in run.events[0][2]
    # each later step waited for the new group to warm up and a whole window after it
    for (a, _), (b, _) in zip(changes, changes[1:]):
        assert b - a >= WARMUP + UP_WINDOW


def test_a_flapping_load_does_not_flap(levels, target):
    """The load swings between 2 and 6 streams every 30 s, faster than the windows: no change."""
    run = simulate(policy(target), square(2, 6, 30), 1800, levels, warmup_s=WARMUP)
    assert run.changes() == [], run.events
    assert any("of the 60s window" in row["reason"] for row in run.ticks)  # misses were seen, never long enough


def test_a_steady_surge_then_a_drop_scales_down_after_the_window_and_never_reverses(levels, target):
    drop_at = 1500
    run = simulate(policy(target, max_groups=4), steps((300, 2), (drop_at, 6), (3600, 1)), 3000, levels,
                   warmup_s=WARMUP)
    peak = run.groups_at(drop_at - 1)
    assert peak >= 2
    assert reversals(run) == 1, run.changes()  # up to the plateau, down after the drop, nothing in between
    downs = [t for t, d in run.changes() if d < 0]
    # latencies are judged over the window's scrapes, which hold the busy minutes until they age out:
    # the first removal comes one to two windows after the drop
    assert drop_at + DOWN_WINDOW <= downs[0] <= drop_at + 2 * DOWN_WINDOW + 2 * TICK, run.events
    assert run.groups_at(3000) == 1
    assert all(e[1] in ("AutoscaleUp", "AutoscaleDown") for e in run.events)


def test_bounds_hold(levels, target):
    busy = simulate(policy(target, min_groups=1, max_groups=2), steps((100, 32)), 1800, levels, warmup_s=WARMUP)
    assert max(row["desired"] for row in busy.ticks) == 2
    assert "already at maxGroups (2)" in busy.ticks[-1]["reason"]
    idle = simulate(policy(target, min_groups=2, max_groups=4), steps((100, 0)), 1800, levels, start_groups=3)
    assert min(row["desired"] for row in idle.ticks) == 2 and idle.groups_at(1800) == 2
    assert "at minGroups (2)" in idle.ticks[-1]["reason"]


def test_no_change_while_a_group_warms_up(levels, target):
    """A warm-up longer than the window: the second group is not asked for before the first serves."""
    run = simulate(policy(target, max_groups=4), steps((0, 32)), 900, levels, warmup_s=300)
    times = [t for t, _ in run.changes()]
    assert len(times) >= 2 and all(b - a >= 300 + UP_WINDOW for a, b in zip(times, times[1:]))
