"""`afd plan`'s cost model and recommendation on synthetic metric streams (pure), and the command."""

import json
import random
import subprocess
import sys

import pytest

from afd.planner.advice import Bounds, TooFewMetrics, plan
from afd.planner.cost import Line
from afd.planner.samples import parse_exposition
from afd.topology import Topology


class Group:
    """A simulated group whose per-step costs follow known lines; emits cumulative /metrics text."""

    def __init__(self, topology: str, stages: int = 1, attention=(2e-3, 1e-4), ffn=(1e-3, 2e-5), host=(4e-3, 2e-5),
                 wire=(5e-4, 1e-6), layers: int = 4, noise: float = 0.0, seed: int = 0):
        self.topology, self.stages, self.layers, self.noise = Topology.parse(topology), stages, layers, noise
        self.lines = {"attention": attention, "ffn": ffn, "host": host, "wire": wire}
        self.totals: dict[tuple, float] = {}
        self.clock = 0.0
        self.random = random.Random(seed)

    def cost(self, term: str, tokens: float) -> float:
        intercept, slope = self.lines[term]
        return (intercept + slope * tokens) * (1 + self.random.uniform(-self.noise, self.noise))

    def run(self, concurrency: float, steps: int = 100, profile_every: int = 4) -> None:
        n = concurrency / self.topology.num_attention
        m = concurrency / self.topology.num_ffn
        step = 0.0
        for s in range(steps):
            attention, ffn = self.cost("attention", n), self.cost("ffn", m)
            exposed = ffn if self.stages == 1 else max(0.0, ffn - attention)
            wait = exposed + self.cost("wire", n)
            step = self.cost("host", n) + attention + wait
            for rank in range(self.topology.num_attention):
                self._add("attention", rank, step, n, generated=n)
                if (s + 1) % profile_every == 0:
                    self._layers("attention", rank, attention, wait)
            for rank in range(self.topology.num_ffn):
                self._add("ffn", rank, step, m * self.layers)  # the FFN counts rows once per crossing layer
                if (s + 1) % profile_every == 0:
                    self._layers("ffn", rank, ffn, 0.0)
            self.clock += step

    def _add(self, role, rank, seconds, tokens, generated=0.0):
        for key, value in (("afd_step_duration_seconds_sum", seconds), ("afd_step_duration_seconds_count", 1),
                           ("afd_step_tokens_sum", tokens), ("afd_step_tokens_count", 1),
                           ("afd_generation_tokens_total", generated)):
            if role == "attention" or key != "afd_generation_tokens_total":
                self.totals[(key, role, rank, None, None)] = self.totals.get((key, role, rank, None, None), 0) + value

    def _layers(self, role, rank, compute, wait):
        for layer in range(self.layers):
            for name, direction, value in (("afd_layer_compute_seconds", None, compute), ("afd_transfer_seconds", "recv", wait)):
                for suffix, amount in (("_sum", value / self.layers), ("_count", 1)):
                    key = (name + suffix, role, rank, layer, direction)
                    self.totals[key] = self.totals.get(key, 0) + amount

    def exposition(self) -> str:
        lines = []
        for rank_role in [("attention", r) for r in range(self.topology.num_attention)] + \
                         [("ffn", r) for r in range(self.topology.num_ffn)]:
            lines.append(f'afd_group_info{{role="{rank_role[0]}",rank="{rank_role[1]}",topology="{self.topology}",'
                         f'stages="{self.stages}"}} 1')
        for (name, role, rank, layer, direction), value in sorted(self.totals.items(), key=str):
            labels = f'role="{role}",rank="{rank}"'
            if layer is not None:
                labels += f',layer="{layer}"'
            if direction is not None:
                labels += f',direction="{direction}"'
            lines.append(f"{name}{{{labels}}} {value}")
        return "\n".join(lines) + "\n"

    def scrapes(self, loads: list[float]) -> list:
        out = [parse_exposition(self.exposition(), self.clock)]
        for load in loads:
            self.run(load)
            out.append(parse_exposition(self.exposition(), self.clock))
        return out


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
