"""The FFN role: its share of the experts, the link its attention peers connect to, the step executor and its
graphs (`build_ffn`), and the worker loop with its probe and metrics server (`serve_ffn`; no HTTP API)."""

from __future__ import annotations

import logging
import threading

import torch

from afd.config import AFDConfig
from afd.connector import registry
from afd.connector.ffn_link import FFNLink
from afd.connector.identity import identity_key
from afd.connector.plane import DataContract, PlaneOptions
from afd.graphs.ffn_graphs import FFNGraphs
from afd.metrics.expert_load import shard_labelled
from afd.metrics.layer_clock import StepInstruments
from afd.metrics.wiring import export_group_info, export_resident_bytes, ffn_instruments, watch_ffn, watched_registry
from afd.roles.share import Share, graphs_usable, load_share
from afd.runners.device import resolve_device, resolve_dtype
from afd.runners.ffn_executor import FFNStepExecutor
from afd.runners.ffn_worker import MIN_STALL_S, FFNWorker
from afd.runners.step_order import step_order
from afd.server.probe_http import Probes, start_probe_server

log = logging.getLogger(__name__)


def assemble_ffn(config: AFDConfig, share: Share, instruments: StepInstruments = StepInstruments()) -> FFNWorker:
    """FFN rank `config.group.rank` around its loaded share: listening for its attention peers."""
    group = config.group
    expected = share.hello(group, config.split, config.link)
    transport = registry.transport(config.link.connector)
    server = transport.open_server(config.link, group.own_endpoint)
    contract = DataContract(share.loaded.spec.hidden_size, share.dtype, expected.router_width)
    plane = transport.ffn_plane(PlaneOptions(share.device, config.link.peer_timeout_s), contract, server)
    served = group.topology.attention_ranks_of(group.rank)
    log.info("ffn rank %d%s serves attention ranks %s on layers %s", group.rank,
             f" shard {group.ffn_shard} of {group.ffn_expert_parallel}" if group.ffn_expert_parallel > 1 else "",
             list(served), list(share.loaded.crossing))
    link = FFNLink(server, plane, expected, served, group.rank, identity_key(group.group_token, group.group_secret))
    graphs = None
    if graphs_usable(config.graphs, config.link, share.device, share.dtype):
        graphs = FFNGraphs(share.device)
    return FFNWorker(link, FFNStepExecutor(share.loaded, plane, expected, graphs, instruments),
                     order=step_order(group, config.link))


def build_ffn(config: AFDConfig, instruments: StepInstruments = StepInstruments(),
              device: torch.device | None = None) -> FFNWorker:
    """FFN rank `config.group.rank` on `device` (None: the config's), listening for its attention peers."""
    device = resolve_device(config.load) if device is None else device
    share = load_share(config.group, config.split, config.load.model, device, resolve_dtype(config.load, device))
    return assemble_ffn(config, share, instruments)


def serve_ffn(config: AFDConfig, stop: threading.Event) -> int:
    """Serve FFN rank `config.group.rank` until `stop` is set; the exit code."""
    group, process = config.group, config.process
    registry = watched_registry(group)  # compiles in steps its peers do not mark warm-up are counted
    device = resolve_device(config.load)  # once per process: the instruments and the weights use it
    share = load_share(group, config.split, config.load.model, device, resolve_dtype(config.load, device))
    export_group_info(registry, group, config.split, config.link)
    worker = assemble_ffn(config, share, ffn_instruments(registry, group, process, device))
    watch_ffn(registry, group, worker)
    export_resident_bytes(registry, group, share.loaded.resident_bytes)
    # preStop drain: tell the attention ranks, serve on until they have finished (or the hook's time is up);
    # /live fails once the worker loop stops coming round (a step hung past every peer timeout)
    stall_s = max(MIN_STALL_S, 10 * config.link.peer_timeout_s)
    probes = Probes(lambda: None, live=lambda: worker.stalled(stall_s), drained=worker.drained,
                    on_drain=worker.request_drain)
    exposed = shard_labelled(registry, group.ffn_shard) if group.ffn_expert_parallel > 1 else registry
    probe = start_probe_server(config.api.http_host, process.metrics_port, probes, exposed)
    log.info("ffn rank %d ready (health and metrics on port %d)", group.rank, process.metrics_port)
    try:
        worker.serve(stop)
    finally:
        probe.shutdown()
    log.info("ffn rank %d stopped after %d steps", group.rank, worker.steps_run)
    return 0
