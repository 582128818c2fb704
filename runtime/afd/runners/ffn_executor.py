"""The FFN step executor: one step for the peers that sent a plan (vLLM v1's model runner, FFN side).

For each crossing layer and each stage: receive the rows of every peer in the step,
concatenate, compute (experts from shipped router logits when the gate runs on attention,
the whole FFN otherwise), split, and send each slice back to its source. Every shape follows
from the plans. The peers that failed the step come back in its result; the worker loop
(`afd.runners.ffn_worker`) drops them.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from afd.connector import wire
from afd.connector.base import ConnectorError, FFNTransfer
from afd.connector.plane import FFNPlane, PeerWatch
from afd.connector.tensors import DTYPES
from afd.kernels.compile_watch import WATCH
from afd.metrics.expert_load import ExpertLoad
from afd.metrics.layer_clock import StepInstruments
from afd.models.loader import LoadedModel

log = logging.getLogger(__name__)


class FFNStepExecutor:
    """Runs steps on one FFN rank's share of the model, over its data plane."""

    def __init__(self, loaded: LoadedModel, plane: FFNPlane, expected: wire.Hello, graphs=None,
                 instruments: StepInstruments = StepInstruments()):
        self.layers = loaded.model.layers
        self.crossing = loaded.crossing
        self.plane = plane
        self.expected = expected
        self.graphs = graphs  # afd.graphs.ffn_graphs.FFNGraphs when CUDA graphs are on (NCCL data plane only)
        self.steps_run = 0
        self.rows_served = 0
        self.transfer_bytes = {"send": 0, "recv": 0}
        self.clock = instruments.clock  # per-layer timings of the steps attention marks `profile`
        self.instruments = instruments
        self.expert_load = ExpertLoad(self.layers, self.crossing)  # tokens per expert, on the same profiled steps

    def run_step(self, plans: dict[bytes, wire.StepPlan], watch: PeerWatch,
                 stop: Callable[[], bool] = lambda: False) -> dict[bytes, str]:
        """One step for every peer in `plans`, eager or captured/replayed as they say; returns the peers that failed it."""
        started, rows_before = time.monotonic(), self.rows_served
        WATCH.set_serving(not any(plan.warmup or plan.capture for plan in plans.values()))  # its compiles' phase
        profiling = any(plan.profile for plan in plans.values())
        self.clock.begin(profiling)
        self._count_bytes(plans)
        failed: dict[bytes, str] = {}
        try:
            if self.graphs is None:
                self._step_body(plans, watch, stop, failed)
            else:
                self.graphs.run(plans, lambda: self._step_body(plans, watch, stop, failed))
            failed.update(self.plane.finish_step(tuple(plans), watch))
        except ConnectorError as err:  # a transfer failed outright (NCCL saw a peer exit): drop who is gone, serve on
            failed.update(self.plane.fail_step(tuple(plans), str(err), watch))
        if profiling:
            self.expert_load.flush()
        self.steps_run += 1
        # from the plans: a replayed graph does not run the body, so counting rows there misses them
        served = sum(sum(plan.stage_tokens) for peer, plan in plans.items() if peer not in failed)
        self.rows_served += served * len(self.crossing)
        if profiling and self.instruments.on_layers is not None:
            self.instruments.on_layers(self.clock.collect())
        if self.instruments.on_step is not None:
            self.instruments.on_step(time.monotonic() - started, self.rows_served - rows_before)
        return failed

    def forget(self, peer: bytes) -> None:
        """A connection went: the graphs keyed by it go too."""
        if self.graphs is not None:
            self.graphs.forget(peer)

    def close(self) -> None:
        if self.graphs is not None:  # graphs go before the links they replay
            self.graphs.clear()

    def _count_bytes(self, plans: dict[bytes, wire.StepPlan]) -> None:
        """Bytes the step moves, from its plans (also right when a graph replays it)."""
        rows = sum(sum(plan.stage_tokens) for plan in plans.values())
        element = DTYPES[self.expected.dtype].itemsize
        per_row = len(self.crossing) * self.expected.hidden_size * element
        self.transfer_bytes["recv"] += rows * (per_row + len(self.crossing) * 4 * self.expected.router_width)
        partial = 4 if self.expected.expert_parallel > 1 else element  # a shard returns float32 partial sums
        self.transfer_bytes["send"] += rows * len(self.crossing) * self.expected.hidden_size * partial

    def _step_body(self, plans: dict[bytes, wire.StepPlan], watch: PeerWatch, stop: Callable[[], bool],
                   failed: dict[bytes, str]) -> None:
        """All crossing layers × stages for the peers in `plans`; capturable with the NCCL data plane."""
        live = dict(sorted(plans.items()))
        clock = self.clock
        for layer in self.crossing:
            for stage in range(self.expected.stages):
                peers = tuple(p for p, plan in live.items() if plan.stage_tokens[stage] > 0)
                if not peers:
                    continue
                steps, rows = tuple(live[p].step_id for p in peers), tuple(live[p].stage_tokens[stage] for p in peers)
                waiting = clock.now()
                received = self.plane.recv(FFNTransfer(layer, stage, peers, steps, rows), watch, stop)
                clock.lap("recv", layer, waiting)
                for peer, reason in received.failed.items():
                    live.pop(peer, None)
                    failed[peer] = reason
                if received.transfer.peers:
                    if clock.active:  # a profiled step runs eagerly: counting here is off the graphs
                        self.expert_load.record(layer, received.hidden, received.logits)
                    computing = clock.now()
                    output = self._compute(layer, received.hidden, received.logits)
                    clock.lap("compute", layer, computing)
                    sending = clock.now()
                    self.plane.send(output, received.transfer)
                    clock.lap("send", layer, sending)
        self.plane.flush()

    def _compute(self, layer_index: int, hidden: torch.Tensor, router_logits: torch.Tensor | None) -> torch.Tensor:
        layer = self.layers[layer_index]
        output = layer.expert_half(hidden, router_logits) if router_logits is not None else layer.ffn_half(hidden)
        # an expert-parallel shard returns a float32 partial sum (afd.models.expert_shard)
        return output.float() if self.expected.expert_parallel > 1 else output
