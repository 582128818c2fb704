"""`afd plan`'s cost model and recommendation on synthetic metric streams (pure), and the command."""

import subprocess
import sys

import pytest

from afd.planner.advice import Bounds, TooFewMetrics, plan
from afd.planner.cost import Line
from afd.planner.samples import parse_exposition
from afd.planner.simulate import SimulatedGroup as Group
from afd.topology import Topology


def test_a_line_needs_two_loads_to_have_a_slope():
    assert Line.fit([(10, 1.0), (10.5, 1.2)]) == Line(1.1, 0.0, False)
    line = Line.fit([(10, 2.0), (20, 3.0), (40, 5.0)])
    assert line.varied and line.slope == pytest.approx(0.1) and line.intercept == pytest.approx(1.0)


def test_the_fit_recovers_the_costs_and_predicts_the_current_topology():
    result = plan(Group("2A1F").scrapes([16, 32, 64, 48]))
    model = result["model"]
    assert model["attention"]["slope_s_per_token"] == pytest.approx(1e-4, rel=1e-3)
    assert model["ffn"]["intercept_s"] == pytest.approx(1e-3, rel=1e-3)
    assert model["ffn"]["slope_s_per_token"] == pytest.approx(2e-5, rel=1e-3)
    assert result["current"] == "2A1F" and result["prediction_error"] < 0.01


def test_attention_bound_group_is_told_to_add_attention_ranks():
    slow_attention = dict(attention=(2e-3, 8e-4), ffn=(1e-3, 1e-5))
    result = plan(Group("1A1F", **slow_attention).scrapes([16, 32, 64]), Bounds(max_gpus=6))
    ratio = Topology.parse(result["recommended"])
    assert ratio.num_attention / ratio.num_ffn > 1, result["why"]
    assert "attention computes" in result["why"] and result["per_gpu"][result["recommended"]] > result["per_gpu"]["1A1F"]


def test_ffn_bound_group_is_told_to_lower_the_ratio():
    slow_ffn = dict(attention=(1e-3, 1e-6), ffn=(2e-2, 2e-4), host=(1e-4, 0))
    result = plan(Group("4A1F", **slow_ffn).scrapes([32, 64, 128]), Bounds(max_gpus=6))
    ratio = Topology.parse(result["recommended"])
    assert ratio.num_attention / ratio.num_ffn < 4, result["why"]


def test_noisy_metrics_give_the_same_advice_and_a_close_prediction():
    slow_attention = dict(attention=(2e-3, 8e-4), ffn=(1e-3, 1e-5))
    clean = plan(Group("1A1F", **slow_attention).scrapes([16, 32, 64]), Bounds(max_gpus=6))
    noisy = plan(Group("1A1F", noise=0.05, seed=3, **slow_attention).scrapes([16, 32, 64]), Bounds(max_gpus=6))
    assert noisy["recommended"] == clean["recommended"]
    assert noisy["prediction_error"] < 0.15


def test_following_the_advice_does_not_flap():
    slow_attention = dict(attention=(2e-3, 8e-4), ffn=(1e-3, 1e-5))
    bounds = Bounds(max_gpus=6)
    first = plan(Group("1A1F", **slow_attention).scrapes([16, 32, 64]), bounds)
    load_per_gpu = 32 / 2
    size = sum(int(part) for part in first["recommended"].rstrip("F").split("A"))
    moved = plan(Group(first["recommended"], **slow_attention).scrapes([load_per_gpu * size * f for f in (0.5, 1, 2)]), bounds)
    assert moved["recommended"] == first["recommended"]


def test_bounds_are_respected():
    slow_attention = dict(attention=(2e-3, 8e-4), ffn=(1e-3, 1e-5))
    result = plan(Group("1A1F", **slow_attention).scrapes([16, 32, 64]), Bounds(max_attention_per_ffn=2, max_gpus=6))
    assert all(Topology.parse(t).num_attention <= 2 * Topology.parse(t).num_ffn for t in result["per_gpu"])
    assert result["recommended"] in ("2A1F", "4A2F")


def test_one_load_gives_a_prediction_but_no_recommendation():
    result = plan(Group("2A1F").scrapes([32, 32, 32]))
    assert result["prediction_error"] < 0.01
    assert result["recommended"] is None and "same batch" in result["why"]


def test_too_few_scrapes_or_no_profiled_steps_say_so():
    group = Group("2A1F")
    with pytest.raises(TooFewMetrics, match="two scrapes"):
        plan(group.scrapes([]))
    unprofiled = Group("2A1F")
    before = parse_exposition(unprofiled.exposition(), 0.0)
    unprofiled.run(32, profile_every=10**9)
    with pytest.raises(TooFewMetrics, match="profiled steps"):
        plan([before, parse_exposition(unprofiled.exposition(), unprofiled.clock)])


def test_afd_plan_command_refuses_bad_input_with_one_line():
    run = lambda *a: subprocess.run([sys.executable, "-m", "afd", "plan", *a], capture_output=True, text=True)  # noqa: E731
    missing = run("--state-file", "/nonexistent/state.json", "--samples", "2", "--interval", "0.01")
    assert missing.returncode == 1 and missing.stderr.startswith("error: cannot plan: --state-file /nonexistent")
    few = run("--scrape", "http://127.0.0.1:1/metrics", "--samples", "1")
    assert few.returncode == 1 and "--samples 1" in few.stderr
    both = run("--scrape", "x", "--state-file", "y")
    assert both.returncode == 2 and "not allowed with" in both.stderr
