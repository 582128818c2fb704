"""The FFN worker loop: the link hands over plans, the step executor runs them (vLLM v1's worker).

Block on the control plane; take the plans that are ready (peers that sent none are not
waited for, so an idle attention rank never stalls a busy one); run the step; drop the
peers it reports failed. No scheduler, no KV cache, no sampling.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from afd.connector.ffn_link import FFNLink
from afd.connector.plane import Interrupted
from afd.runners.ffn_executor import FFNStepExecutor
from afd.runners.step_order import LocalOrder

log = logging.getLogger(__name__)
PROBE_INTERVAL_S = 1.0  # how often idle peers are probed (a peer whose process died is dropped)
# The loop comes round within a poll interval when idle and after each step when busy (a step gives up
# on a silent peer within its timeout): this long without a round, the worker is wedged (/live: 503).
MIN_STALL_S = 120.0


class FFNWorker:
    """Serves the attention ranks of one FFN rank until `stop` is set."""

    def __init__(self, link: FFNLink, executor: FFNStepExecutor, batch_window_s: float = 0.0, order=None):
        self.link, self.executor = link, executor
        # which plans a step runs (afd.runners.step_order); the batch window waits for every connected peer's plan
        self.order = order or LocalOrder(batch_window_s)
        link.watch_gone(executor.forget)
        self.last_round = time.monotonic()  # when the serve loop last came round (liveness)

    def serve(self, stop: threading.Event) -> None:
        """The daemon loop; returns within one poll interval of `stop` being set, even mid-step."""
        link = self.link
        next_probe = time.monotonic() + PROBE_INTERVAL_S
        try:
            while not stop.is_set():
                self.last_round = time.monotonic()
                link.tell_draining()
                if time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + PROBE_INTERVAL_S
                    link.probe()
                plans = self.order.take(link)
                if plans:
                    self.run_step(plans, stop)
        except Interrupted:
            log.info("ffn rank %d interrupted mid-step by shutdown", link.ffn_rank)
        finally:
            self.executor.close()
            self.order.close()
            link.close()

    def run_step(self, plans, stop: threading.Event | None = None) -> None:
        """One step; the peers that failed it are dropped, the others serve on."""
        with torch.inference_mode(), self.link.running_step():
            failed = self.executor.run_step(plans, self.link, stop.is_set if stop else lambda: False)
        for peer, reason in failed.items():
            self.link.drop(peer, reason)

    def stalled(self, limit_s: float) -> str | None:
        """Liveness: why the worker counts as wedged (no loop round for `limit_s`), else None."""
        idle = time.monotonic() - self.last_round
        return f"the ffn worker loop has not come round for {idle:.0f} s" if idle > limit_s else None

    # the preStop drain and the counters, for the probes and the logs
    def request_drain(self) -> None:
        self.link.request_drain()

    def drained(self) -> bool:
        return self.link.drained()

    @property
    def steps_run(self) -> int:
        return self.executor.steps_run
