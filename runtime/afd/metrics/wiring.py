"""Attach the metrics of a role to its runner: its registry (`watched_registry`), layer clock, per-layer
histograms, collectors."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from afd.config import GroupSettings, LinkSettings, ProcessSettings, SplitSettings
from afd.kernels.compile_watch import WATCH
from afd.metrics.expert_load import ExpertLoadCollector
from afd.metrics.ffn_metrics import FFNLinkMetrics, FFNStepMetrics
from afd.metrics.layer_clock import LayerClock, StepInstruments
from afd.metrics.layer_metrics import LayerMetrics, RunnerCollector


def watched_registry(group: GroupSettings) -> CollectorRegistry:
    """A serving rank's registry, made before its role is built: Triton kernels compiled after warm-up are logged
    and counted there."""
    series = CollectorRegistry()
    if WATCH.install():
        export_kernel_compiles(series, group, WATCH)
    return series


def export_group_info(registry: CollectorRegistry, group: GroupSettings, split: SplitSettings,
                      link: LinkSettings) -> None:
    """`afd_group_info{topology,stages,gate,connector}` 1: the shape `afd plan` needs besides the series."""
    Gauge("afd_group_info", "The group this rank belongs to", ["role", "rank", "topology", "stages", "gate", "connector"],
          registry=registry).labels(role=group.role, rank=str(group.rank), topology=str(group.topology),
                                    stages=str(split.stages), gate="attention" if split.gate_on_attention else "ffn",
                                    connector=link.connector).set(1)


def export_resident_bytes(registry: CollectorRegistry, group: GroupSettings, resident_bytes: int) -> None:
    """`afd_weights_resident_bytes{role,rank}`: the model bytes this rank holds (weights, FP8 scales, norms; an
    expert-parallel FFN shard's series also carry its `shard`), as the loader counted them."""
    Gauge("afd_weights_resident_bytes", "Bytes of model weights (FP8 scales included) resident on this rank",
          ["role", "rank"], registry=registry).labels(role=group.role, rank=str(group.rank)).set(resident_bytes)


def export_kernel_compiles(registry: CollectorRegistry, group: GroupSettings, watch) -> None:
    """`afd_kernel_compiles_total{role,rank}`: Triton kernel specializations compiled while serving (each paused
    the step that met it); `watch` is `afd.kernels.compile_watch.WATCH`, already installed."""
    counter = Counter("afd_kernel_compiles", "Triton kernel specializations compiled while serving, after warm-up "
                      "(each pauses the step that met it)", ["role", "rank"], registry=registry)
    series = counter.labels(role=group.role, rank=str(group.rank))
    watch.on_serving_compile(lambda _description: series.inc())


def attention_instruments(registry: CollectorRegistry, group: GroupSettings, process: ProcessSettings,
                          device) -> StepInstruments:
    """The per-layer series of an attention rank, to build its runner with (its group info: `export_group_info`)."""
    return StepInstruments(LayerClock(device, process.profile_every),
                           LayerMetrics(registry, "attention", group.rank).observe)


def watch_attention(registry: CollectorRegistry, group: GroupSettings, role, engine) -> None:
    """The series read from a built attention rank and its engine: its counters and its FFN link."""
    ffn_rank = group.topology.ffn_rank_of(group.rank)
    RunnerCollector(registry, "attention", group.rank, role.runner,
                    link_state=lambda: (ffn_rank, engine.error is None, engine.reconnects, role.link.recover_failures))


def ffn_instruments(registry: CollectorRegistry, group: GroupSettings, process: ProcessSettings,
                    device) -> StepInstruments:
    """The step series of an FFN rank, to build its executor with (its group info: `export_group_info`)."""
    return StepInstruments(LayerClock(device, process.profile_every), LayerMetrics(registry, "ffn", group.rank).observe,
                           FFNStepMetrics(registry, group.rank).on_step)


def watch_ffn(registry: CollectorRegistry, group: GroupSettings, worker) -> None:
    """The series read from a built FFN worker: its peers, refusals and rejections, its counters."""
    metrics = FFNLinkMetrics(registry, group.rank, worker.link)
    for attention_rank in group.topology.attention_ranks_of(group.rank):
        metrics.on_peer(attention_rank, False)  # every served peer exported (0) before it connects
    worker.link.watch_peers(metrics.on_peer)
    RunnerCollector(registry, "ffn", group.rank, worker.executor)
    ExpertLoadCollector(registry, group.rank, group.ffn_shard, worker.executor.expert_load)
