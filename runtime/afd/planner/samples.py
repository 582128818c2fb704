"""Prometheus expositions of AFD ranks → what one step cost each rank over a time window (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# series a window needs, by exposition name (histograms by their _sum/_count samples)
_SUMMED = ("afd_step_duration_seconds", "afd_step_tokens")
_PER_LAYER = ("afd_layer_compute_seconds", "afd_transfer_seconds")
_COUNTED = ("afd_generation_tokens_total", "afd_prefix_cache_queries_total", "afd_prefix_cache_hits_total")


@dataclass(frozen=True)
class RankSample:
    """Cumulative counters of one rank at one time: {key: value}, keys like 'afd_step_tokens_sum'
    or 'afd_layer_compute_seconds_sum|3|' (layer 3) or 'afd_transfer_seconds_count|3|recv'."""

    role: str
    rank: int
    at: float
    values: dict[str, float]
    info: dict[str, str] = field(default_factory=dict)  # topology, stages, gate from afd_group_info


def parse_exposition(text: str, at: float) -> list[RankSample]:
    """Every (role, rank) found in one scrape's text."""
    values: dict[tuple[str, int], dict[str, float]] = {}
    infos: dict[tuple[str, int], dict[str, str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if "role" not in labels or "rank" not in labels:
                continue
            key = (labels["role"], int(labels["rank"]))
            name = sample.name
            if name == "afd_group_info":
                infos[key] = {k: v for k, v in labels.items() if k not in ("role", "rank")}
                continue
            base = name.rsplit("_", 1)[0] if name.endswith(("_sum", "_count")) else name
            if base in _PER_LAYER and name.endswith(("_sum", "_count")):
                name = f"{name}|{labels.get('layer', '')}|{labels.get('direction', '')}"
            elif not (base in _SUMMED or name in _COUNTED):
                continue
            bucket = values.setdefault(key, {})
            bucket[name] = bucket.get(name, 0.0) + sample.value
    return [RankSample(role, rank, at, vals, infos.get((role, rank), {})) for (role, rank), vals in sorted(values.items())]


@dataclass(frozen=True)
class RankWindow:
    """Per-step means of one rank between two samples."""

    role: str
    rank: int
    seconds: float
    steps: float
    tokens_per_step: float  # attention: tokens computed per engine step; FFN: rows per crossing layer per step
    step_s: float  # wall time of a step: its mean duration, or the time between steps when they overlap
    compute_s: float  # compute of a profiled step, summed over layers
    wait_s: float  # attention: waiting for FFN outputs in a profiled step (0 on the FFN)
    send_s: float  # time spent handing inputs to the connector in a profiled step
    generated_per_step: float  # attention: tokens generated per step (0 on the FFN)
    profiled_steps: float
    prompt_tokens: float = 0.0  # attention: prompt tokens admitted with prefix caching on, and of them found cached
    cached_tokens: float = 0.0  # (not computed: the steps' measured tokens already leave them out)


def window(before: RankSample, after: RankSample) -> RankWindow | None:
    """The window between two samples of one rank; None when it ran no profiled step."""
    if (before.role, before.rank) != (after.role, after.rank):
        raise ValueError("a window needs two samples of the same rank")
    delta = {key: after.values[key] - before.values.get(key, 0.0) for key in after.values}
    steps = delta.get("afd_step_duration_seconds_count", 0.0)
    per_layer = _per_layer_means(delta)
    profiled = max((count for (_, count) in per_layer.values()), default=0.0)
    if steps <= 0 or profiled <= 0:
        return None
    tokens = delta.get("afd_step_tokens_sum", 0.0) / max(delta.get("afd_step_tokens_count", 0.0), 1.0)
    duration = delta.get("afd_step_duration_seconds_sum", 0.0) / steps
    # the serving loop runs one step ahead: a step's duration (launch to tokens out) also spans the next
    # step's launch, so busy steps follow each other every seconds/steps, down to half their duration
    # (the clamp bounds the error of instants that are not scrape times, as Prometheus queries give)
    step_s = min(duration, max(duration / 2, (after.at - before.at) / steps))
    if after.role == "ffn":  # the FFN counts each row once per crossing layer
        tokens /= max(1, len({layer for (kind, layer) in per_layer if kind == "compute"}))
    return RankWindow(
        role=after.role,
        rank=after.rank,
        seconds=after.at - before.at,
        steps=steps,
        tokens_per_step=tokens,
        step_s=step_s,
        compute_s=_total(per_layer, "compute"),
        wait_s=_total(per_layer, "recv") if after.role == "attention" else 0.0,
        send_s=_total(per_layer, "send"),
        generated_per_step=delta.get("afd_generation_tokens_total", 0.0) / steps,
        profiled_steps=profiled,
        prompt_tokens=delta.get("afd_prefix_cache_queries_total", 0.0),
        cached_tokens=delta.get("afd_prefix_cache_hits_total", 0.0),
    )


def _per_layer_means(delta: dict[str, float]) -> dict[tuple[str, str], tuple[float, float]]:
    """(kind, layer) → (mean seconds per profiled step, profiled steps); kind is compute, send or recv."""
    out = {}
    for key, total in delta.items():
        if "|" not in key or not key.split("|")[0].endswith("_sum"):
            continue
        name, layer, direction = key.split("|")
        count = delta.get(f"{name[: -len('_sum')]}_count|{layer}|{direction}", 0.0)
        if count > 0:
            kind = "compute" if name.startswith("afd_layer_compute") else direction
            out[(kind, layer)] = (total / count, count)
    return out


def _total(per_layer: dict, kind: str) -> float:
    return sum(mean for (which, _), (mean, _) in per_layer.items() if which == kind)
