"""The FFN role's graph cache: one captured step per (peer, per-stage token counts) key.

The attention side drives warm-up and capture through its step plans; the FFN only
obeys them. A graph is replayed only when every plan of the step says `replay` and its
key was captured; any other step runs eagerly, even when a graph for its key exists.
Replays and eager steps (by reason) are counted for `afd_graph_replays_total` and
`afd_graph_eager_steps_total{reason}`. A step whose plans all say replay but whose key
is new (a peer left or joined, so the peers of a step changed) is captured on the spot,
up to `max_graphs`: capturing only records, the replay right after does the transfers,
exactly as when the plans say capture.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

import torch

from afd.connector.identity import show
from afd.graphs.buckets import ffn_graph_key, ffn_step_mode
from afd.graphs.capture import make_pool

log = logging.getLogger(__name__)


class FFNGraphs:
    def __init__(self, device: torch.device, max_graphs: int = 64):
        self.device = device
        self.pool = make_pool(device)
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, object] = {}
        self.replays = 0
        self.eager_steps: Counter[str] = Counter()

    @property
    def memory_bytes(self) -> int:
        return self.pool.memory_bytes

    def run(self, plans: dict, body: Callable[[], None]) -> str:
        """Run one step as its plans say; returns the mode used (replay, capture or eager)."""
        key = ffn_graph_key({peer: plan.stage_tokens for peer, plan in plans.items()})
        flags = [(plan.warmup, plan.capture, plan.replay) for plan in plans.values()]
        mode, reason = ffn_step_mode(flags, key in self.graphs, may_capture=len(self.graphs) < self.max_graphs)
        if mode == "replay":
            self.graphs[key].replay()
            self.replays += 1
        elif mode == "capture":
            self.graphs[key] = self.pool.capture(body)
            self.graphs[key].replay()  # capturing only recorded: the step's transfers happen now
            log.info("ffn captured a step graph for %s (pool %.1f MiB)",
                     [(show(peer), tokens) for peer, tokens in key], self.memory_bytes / 2**20)
        else:
            self.eager_steps[reason] += 1
            body()
        return mode

    def forget(self, peer: bytes) -> None:
        """Drop the graphs that replay transfers with `peer` (its pair is gone)."""
        self.graphs = {key: graph for key, graph in self.graphs.items() if all(p != peer for p, _ in key)}
        if not self.graphs:
            self._new_pool()

    def clear(self) -> None:
        self.graphs.clear()
        self._new_pool()

    def _new_pool(self) -> None:
        # once its last graph is gone a CUDA graph pool is dead: torch refuses (an internal assert
        # that kills the process) to capture into it again, so later captures get a fresh pool
        self.pool = make_pool(self.device)
