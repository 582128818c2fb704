"""Check a fit against chosen steady windows, and predict other topologies at their loads (pure).

The model is fitted once over every window of the scrapes (steady ones and the transitions
between them, as `afd plan` does); each steady window is then compared with the model at that
window's measured tokens per step, as `afd plan` compares its latest window. With `held_out`, each
steady window is also predicted by a fit over the other windows but the one before it (the ramp into
its load, which saw nearly the same batch): an out-of-sample check.
"""

from __future__ import annotations

from afd.planner.advice import PREDICTION_TOLERANCE, Bounds, TooFewMetrics, describe, fit, recommend, window_rates
from afd.planner.samples import RankSample
from afd.config.topology import Topology


def check_levels(scrapes: list[list[RankSample]], steady: list[int], topologies: list[str],
                 bounds: Bounds = Bounds(), held_out: bool = False) -> dict:
    """Per steady window index: measured vs predicted tokens/s of the current topology, and each of
    `topologies` predicted at the same load per GPU (tokens/s of one group and per GPU)."""
    fitted = fit(scrapes)
    if not fitted.model.can_extrapolate:
        raise TooFewMetrics("every window saw about the same batch, so the costs' growth with the batch is unknown: "
                            "use loads further apart")
    current = fitted.topology
    gpus = current.num_attention + current.num_ffn
    levels = []
    for index in steady:
        rates = window_rates(fitted, index)
        if not rates["measured_tokens_per_s"]:
            raise TooFewMetrics(f"window {index}: no attention rank generated tokens in a profiled step there")
        predictions = {}
        for name in topologies:
            topology = Topology.parse(name)
            size = topology.num_attention + topology.num_ffn
            concurrency = rates["concurrency"] * size / gpus
            tokens_per_s = fitted.model.tokens_per_s(topology, concurrency)
            predictions[name] = {"concurrency": round(concurrency, 2), "tokens_per_s": round(tokens_per_s, 2),
                                 "per_gpu": round(tokens_per_s / size, 2)}
        advice = recommend(fitted.model, current, rates["concurrency"], bounds)
        if held_out:
            rates["held_out"] = _held_out(scrapes, index)
        levels.append({"window": index, **rates, "within_tolerance": rates["prediction_error"] <= PREDICTION_TOLERANCE,
                       "predictions": predictions, "recommended": advice["recommended"],
                       "predicted_gain": advice.get("predicted_gain"), "why": advice["why"]})
    return {"current": str(current), "stages": fitted.stages, "windows": len(fitted.windows),
            "fit_step_error_median": round(fitted.step_errors[len(fitted.step_errors) // 2], 4),
            "model": describe(fitted.model), "levels": levels}


def _held_out(scrapes: list[list[RankSample]], index: int) -> dict:
    """Window `index` predicted by a fit without it and the window before (None where no window is left)."""
    index %= len(scrapes) - 1
    try:
        fitted = fit(scrapes, skip=frozenset({index, index - 1}) if index else frozenset({index}))
    except TooFewMetrics:
        return {"predicted_tokens_per_s": None, "prediction_error": None, "extrapolates": False}
    rates = window_rates(fitted, index)
    return {"predicted_tokens_per_s": rates["predicted_tokens_per_s"], "prediction_error": rates["prediction_error"],
            "extrapolates": fitted.model.can_extrapolate}
