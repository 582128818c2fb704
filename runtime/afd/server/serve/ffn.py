"""`afd serve` on an FFN rank: the worker loop with its probe and metrics server (beside `serve/attention.py`)."""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry

from afd.config import AFDConfig
from afd.metrics.expert_load import shard_labelled
from afd.kernels.compile_watch import WATCH
from afd.metrics.wiring import export_group_info, export_kernel_compiles, export_resident_bytes, ffn_instruments, watch_ffn
from afd.roles import assemble_ffn, load_share
from afd.runners.device import resolve_device
from afd.runners.ffn_worker import MIN_STALL_S
from afd.server.probe_http import Probes, start_probe_server

log = logging.getLogger(__name__)


def serve_ffn(config: AFDConfig, stop: threading.Event) -> int:
    """Serve FFN rank `config.group.rank` until `stop` is set; the exit code."""
    group, process = config.group, config.process
    registry = CollectorRegistry()
    if WATCH.install():  # Triton kernels compiled in steps its peers do not mark warm-up are logged and counted
        export_kernel_compiles(registry, group, WATCH)
    share = load_share(config)
    export_group_info(registry, group, config.split, config.link)
    worker = assemble_ffn(config, share, ffn_instruments(registry, group, process, resolve_device(config.load)))
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
