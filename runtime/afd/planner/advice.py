"""From a series of scrapes to `afd plan`'s answer: measured, predicted, recommended (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from afd.planner.cost import CostModel, fit_model
from afd.planner.samples import RankSample, RankWindow, window
from afd.config.topology import Topology

PREDICTION_TOLERANCE = 0.15


@dataclass(frozen=True)
class Bounds:
    """Which topologies may be recommended."""

    min_attention_per_ffn: float = 1.0
    max_attention_per_ffn: float = 8.0
    max_gpus: int = 16
    min_gain: float = 0.10  # recommend a change only for at least this much more tokens/s per GPU

    def __post_init__(self) -> None:
        if not 1 <= self.min_attention_per_ffn <= self.max_attention_per_ffn:
            raise ValueError(f"attention per FFN bounds {self.min_attention_per_ffn}..{self.max_attention_per_ffn}: "
                             "need 1 <= min <= max")
        if self.max_gpus < 2:
            raise ValueError(f"max_gpus={self.max_gpus}: an AFD group needs at least 2")

    def candidates(self) -> list[Topology]:
        found = []
        for ffn in range(1, self.max_gpus):
            for attention in range(ffn, self.max_gpus - ffn + 1):
                if self.min_attention_per_ffn <= attention / ffn <= self.max_attention_per_ffn:
                    found.append(Topology(attention, ffn))
        return found


class TooFewMetrics(ValueError):
    """The scrapes cannot support a fit; the text says what is missing."""


def rank_windows(scrapes: list[list[RankSample]]) -> list[dict[tuple[str, int], RankWindow]]:
    """Consecutive scrapes → per window, each rank's window (ranks with no profiled step left out)."""
    out = []
    for before, after in zip(scrapes, scrapes[1:]):
        earlier = {(s.role, s.rank): s for s in before}
        found = {}
        for sample in after:
            key = (sample.role, sample.rank)
            if key in earlier and (w := window(earlier[key], sample)) is not None:
                found[key] = w
        out.append(found)
    return out


def topology_of(scrapes: list[list[RankSample]]) -> tuple[Topology, int]:
    """The deployment's topology and stage count, from afd_group_info (else from the ranks seen)."""
    last = scrapes[-1]
    info = next((s.info for s in last if s.info.get("topology")), None)
    if info:
        return Topology.parse(info["topology"]), int(info.get("stages", 1))
    roles = {role: {s.rank for s in last if s.role == role} for role in ("attention", "ffn")}
    if not roles["attention"] or not roles["ffn"]:
        raise TooFewMetrics("the scrapes hold no attention or no FFN rank: scrape every rank of one group")
    return Topology(len(roles["attention"]), len(roles["ffn"])), 1


@dataclass(frozen=True)
class Fitted:
    """A cost model fitted over every window of a series of scrapes, and those windows."""

    model: CostModel
    topology: Topology
    stages: int
    windows: list[dict[tuple[str, int], RankWindow]]  # consecutive scrapes' windows, in order
    step_errors: list[float]  # |model - measured| / measured step time of every (attention, FFN) pair, sorted


def fit(scrapes: list[list[RankSample]], skip: frozenset[int] = frozenset()) -> Fitted:
    """Fit the cost model over all windows (but the indices in `skip`, kept for comparison) of at least two
    scrapes of every rank of one group."""
    if len(scrapes) < 2:
        raise TooFewMetrics("need at least two scrapes (a window) of every rank")
    topology, stages = topology_of(scrapes)
    pairs, ffn_windows = [], []
    windows = rank_windows(scrapes)
    for index, found in enumerate(windows):
        if index in skip:
            continue
        ffn_windows += [w for (role, _), w in found.items() if role == "ffn"]
        for (role, rank), w in found.items():
            ffn = found.get(("ffn", topology.ffn_rank_of(rank))) if role == "attention" else None
            if ffn is not None:
                pairs.append((w, ffn))
    if not pairs:
        raise TooFewMetrics("no window where an attention rank and its FFN rank both ran profiled steps: "
                            "send traffic (profiling samples every AFD_PROFILE_EVERY-th step) and scrape again")
    model = fit_model(pairs, ffn_windows, stages)
    step_errors = sorted(abs(model.step_seconds(a.tokens_per_step, f.tokens_per_step) - a.step_s) / a.step_s
                         for a, f in pairs)
    return Fitted(model, topology, stages, windows, step_errors)


def window_rates(fitted: Fitted, index: int) -> dict:
    """Measured and predicted generated tokens/s of the group over window `index` (the model at
    that window's measured tokens per step), and its decoding concurrency; 0 where no attention
    rank ran a profiled step in it."""
    found, topology = fitted.windows[index], fitted.topology
    attention = [w for (role, _), w in found.items() if role == "attention"]
    measured = sum(w.generated_per_step * w.steps / w.seconds for w in attention)
    predicted = sum(w.generated_per_step / fitted.model.step_seconds(
        w.tokens_per_step, _ffn_rows(found, topology, w.rank, w.tokens_per_step)) for w in attention)
    concurrency = sum(w.tokens_per_step for w in attention) * topology.num_attention / max(len(attention), 1)
    queried = sum(w.prompt_tokens for w in attention)
    return {"measured_tokens_per_s": round(measured, 2), "predicted_tokens_per_s": round(predicted, 2),
            "prediction_error": round(abs(predicted - measured) / measured, 4) if measured else None,
            "concurrency": round(concurrency, 2),
            # prompt tokens found in the prefix cache are never computed: the fitted step cost sees only the rest
            "prefix_hit_rate": round(sum(w.cached_tokens for w in attention) / queried, 4) if queried else None}


def plan(scrapes: list[list[RankSample]], bounds: Bounds = Bounds()) -> dict:
    """`afd plan --json`'s answer from at least two scrapes of every rank of one group."""
    fitted = fit(scrapes)
    latest = window_rates(fitted, -1)
    result = {"current": str(fitted.topology), "stages": fitted.stages, **latest, "windows": len(scrapes) - 1,
              "fit_step_error_median": round(fitted.step_errors[len(fitted.step_errors) // 2], 4),
              "model": describe(fitted.model)}
    advice = recommend(fitted.model, fitted.topology, latest["concurrency"], bounds)
    if advice.get("recommended") == str(fitted.topology):  # the current topology: its prediction at the measured rows
        advice["recommended_tokens_per_s"] = result["predicted_tokens_per_s"]
    return result | advice


def _ffn_rows(latest: dict, topology: Topology, attention_rank: int, tokens: float) -> float:
    """Rows per step of the rank's FFN in the latest window; without a profiled FFN step there,
    what its attention ranks would send at `tokens` each."""
    ffn_rank = topology.ffn_rank_of(attention_rank)
    ffn = latest.get(("ffn", ffn_rank))
    return ffn.tokens_per_step if ffn is not None else tokens * len(topology.attention_ranks_of(ffn_rank))


def recommend(model: CostModel, current: Topology, concurrency: float, bounds: Bounds) -> dict:
    if concurrency <= 0:
        return {"recommended": None, "why": "no decoding sequences in the last window: nothing to plan for"}
    gpus = current.num_attention + current.num_ffn
    per_gpu_load = concurrency / gpus
    busy = model.busy(current, concurrency)
    shares = f"attention computes {busy['attention']:.0%} of a step, the FFN {busy['ffn']:.0%}, the host {busy['host']:.0%}"
    busy = {side: round(share, 4) for side, share in busy.items()}
    if not model.can_extrapolate:
        return {"recommended": None, "per_gpu": {}, "busy": busy, "why": (
            f"{shares}; every window saw about the same batch, so how the costs grow with the batch is unknown: "
            "scrape while the load changes (e.g. more or fewer concurrent requests) to get a recommendation")}
    per_gpu = {}
    for topology in bounds.candidates():
        size = topology.num_attention + topology.num_ffn
        per_gpu[str(topology)] = round(model.tokens_per_s(topology, per_gpu_load * size) / size, 2)
    now = per_gpu.get(str(current)) or model.tokens_per_s(current, concurrency) / gpus
    chosen = Topology.parse(max(per_gpu, key=per_gpu.get))
    if per_gpu[str(chosen)] < now * (1 + bounds.min_gain):
        chosen, why = current, f"{shares}; no topology within the bounds is {bounds.min_gain:.0%} better per GPU"
    else:
        side = "attention" if chosen.num_attention / chosen.num_ffn > current.num_attention / current.num_ffn else "FFN"
        why = (f"{shares}; more {side} ranks per group balance the two sides: {chosen} predicts "
               f"{per_gpu[str(chosen)] / now - 1:+.0%} tokens/s per GPU at the same load per GPU")
    size = chosen.num_attention + chosen.num_ffn
    gain = per_gpu[str(chosen)] / now - 1 if chosen != current else 0.0
    return {"recommended": str(chosen), "recommended_tokens_per_s": round(per_gpu.get(str(chosen), now) * size, 2),
            "predicted_gain": round(gain, 4), "per_gpu": per_gpu, "busy": busy, "why": why}


def describe(model: CostModel) -> dict:
    terms = {"host": model.host, "attention": model.attention, "send": model.send, "wire": model.wire, "ffn": model.ffn}
    return {name: {"intercept_s": round(line.intercept, 6), "slope_s_per_token": round(line.slope, 9),
                   "varied": line.varied} for name, line in terms.items()}
