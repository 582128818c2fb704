"""`afd plan`'s cost model fitted to metrics of a real CPU group, not to a simulation of the model itself.

The other planner and ratio tests fit the linear cost model to synthetic metrics that the same model generated
(`afd.planner.simulate`), so a small prediction error there is nearly given. Here the scrapes come from one
`afd up` 2A1F group of the tiny Qwen3-MoE on CPU, streaming clients in phases of 2, 6, 12 and 8, recorded once:

    .venv/bin/python bench/cluster/plan_check.py --phases 2,6,12,8 --seconds 15 \
        --dump tests/runtime/traces/plan-cpu-2A1F.json

The plan's prediction of the last (steady) window, and each steady window predicted by a fit that never saw it or
the ramp into it, are printed and bounded.
"""

import json
from pathlib import Path

from afd.planner.advice import PREDICTION_TOLERANCE, plan
from afd.planner.levels import check_levels
from afd.planner.samples import RankSample

TRACE = Path(__file__).parent / "traces" / "plan-cpu-2A1F.json"
STEADY = [0, 2, 4, 6]  # two scrapes a phase: windows 0, 2, 4, 6 lie inside a phase, 1, 3, 5 span its change
# every steady window: the recording's CPU was shared (load average 12-13), which moves a window's step time by
# 10-20 % on its own (bench/RESULTS.md, plan_check); recorded: 8-23 % in sample, 10-32 % held out
WINDOW_TOLERANCE, HELD_OUT_TOLERANCE = 0.25, 0.35


def recorded_scrapes() -> list[list[RankSample]]:
    return [[RankSample(**sample) for sample in scrape] for scrape in json.loads(TRACE.read_text())]


def test_the_plan_predicts_the_recorded_groups_last_window():
    result = plan(recorded_scrapes())
    print(f"\nrecorded CPU 2A1F: measured {result['measured_tokens_per_s']} tok/s, predicted "
          f"{result['predicted_tokens_per_s']}, error {result['prediction_error']:.1%}; median step-time error of "
          f"the fit {result['fit_step_error_median']:.1%}")
    assert result["current"] == "2A1F" and result["windows"] == len(STEADY) * 2 - 1
    assert result["prediction_error"] <= PREDICTION_TOLERANCE


def test_each_recorded_load_is_predicted_by_a_fit_that_never_saw_it():
    levels = check_levels(recorded_scrapes(), STEADY, ["2A1F"], held_out=True)["levels"]
    errors = {level["window"]: (level["prediction_error"], level["held_out"]["prediction_error"]) for level in levels}
    print("\nwindow: (in-sample error, held-out error) " + json.dumps(errors))
    assert all(error <= WINDOW_TOLERANCE for error, _ in errors.values()), errors
    assert all(held is not None and held <= HELD_OUT_TOLERANCE for _, held in errors.values()), errors
