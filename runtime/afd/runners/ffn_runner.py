"""The FFN daemon loop (the seed's FFN runtime, point by point).

Block on the control plane; gather the step plans that are ready; then for each
crossing layer and each stage: receive the rows of every peer in the step,
concatenate, compute (experts from shipped router logits when the gate runs on
attention, the whole FFN otherwise), split, and send each slice back to its source.
Peers that have not sent a plan are not waited for, so an idle attention rank never
stalls a busy one. No scheduler, no KV cache, no sampling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch

from afd.connector import wire
from afd.connector.base import ConnectorError, FFNTransfer
from afd.connector.ffn_side import FFNConnector, Interrupted
from afd.connector.identity import check_identity, identity_key, show
from afd.connector.tensors import DTYPES
from afd.models.loader import LoadedModel
from afd.metrics.layer_clock import NullClock
from afd.runners.handshake import check_hello

log = logging.getLogger(__name__)
POLL_INTERVAL_S = 0.1
PROBE_INTERVAL_S = 1.0  # how often idle peers are probed (a peer whose process died is dropped)
DRAIN_NOTICE_S = 5.0  # after the notice, attention pods need this long to leave every proxy's endpoints
DRAIN_QUIET_S = 1.0  # then no step for this long: the requests they were running have finished
MAX_RETIRED = 4096  # connection identities remembered as used, so a replayed Hello is refused


class FFNRunner:
    """Serves the attention ranks of one FFN rank until `stop` is set."""

    def __init__(
        self,
        loaded: LoadedModel,
        connector: FFNConnector,
        expected_hello: wire.Hello,
        served_ranks: tuple[int, ...],
        ffn_rank: int,
        identity_key: bytes = identity_key("", ""),
    ):
        self.layers = loaded.model.layers
        self.crossing = loaded.crossing
        self.connector = connector
        self.expected = expected_hello
        self.served_ranks = served_ranks
        self.ffn_rank = ffn_rank
        self.identity_key = identity_key  # proves a connection identity was made by the group (afd.connector.identity)
        self.peers: dict[bytes, int] = {}  # connection identity → attention rank
        self.replies: dict[bytes, wire.HelloReply] = {}  # what each live connection was answered: a repeated Hello gets it again
        self.retired: dict[bytes, None] = {}  # identities of closed connections, oldest first
        self.queued: dict[bytes, deque[wire.StepPlan]] = {}  # plans received, not yet run, per peer
        self.steps_run = 0
        self.rows_served = 0
        self.graphs = None  # afd.graphs.ffn.FFNGraphs when CUDA graphs are on (NCCL data plane only)
        self.batch_window_s = 0.0  # wait this long for every connected peer's plan before a step
        self.observer = None  # metrics: on_step(seconds, rows), on_peer(rank, up)
        self.clock = NullClock()  # per-layer timings of the steps attention marks `profile`
        self.on_layers = None  # receives (kind, layer, seconds) of each profiled step
        self.transfer_bytes = {"send": 0, "recv": 0}
        self.handshake_failures = 0
        self.drain_started: float | None = None  # monotonic time of request_drain()
        self.last_plan_at = 0.0
        self._told_draining: set[bytes] = set()

    def serve(self, stop: threading.Event) -> None:
        """The daemon loop; returns within one poll interval of `stop` being set, even mid-step."""
        self.connector.interrupt = stop
        next_probe = time.monotonic() + PROBE_INTERVAL_S
        try:
            while not stop.is_set():
                if self.drain_started is not None:
                    self._tell_draining()
                if time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + PROBE_INTERVAL_S
                    self._probe_peers()
                waiting = 0.0 if any(self.queued.values()) else POLL_INTERVAL_S
                for peer, message in self.connector.poll_control(waiting):
                    self._on_control(peer, message)
                plans = self._next_plans()
                if plans and self.batch_window_s:
                    self._gather_more(plans)
                if plans:
                    with torch.inference_mode():
                        self.run_step(plans)
        except Interrupted:
            log.info("ffn rank %d interrupted mid-step by shutdown", self.ffn_rank)
        finally:
            if self.graphs is not None:  # graphs go before the links they replay
                self.graphs.clear()
            for peer in list(self.peers):
                self.connector.send_control(peer, wire.Goodbye("ffn rank shutting down"))
            self.connector.close()

    def request_drain(self) -> None:
        """Any thread (the preStop hook): tell every attention peer this rank is about to stop."""
        if self.drain_started is None:
            self.drain_started = time.monotonic()

    def drained(self) -> bool:
        """Nothing left to serve: no peer is connected, or since the notice had time to take
        effect no peer has sent a step for a while (their running requests are done)."""
        if not self.peers:
            return True
        if self.drain_started is None:
            return False
        now = time.monotonic()
        return now - self.drain_started >= DRAIN_NOTICE_S and now - self.last_plan_at >= DRAIN_QUIET_S

    def _tell_draining(self) -> None:
        for peer in [p for p in self.peers if p not in self._told_draining]:
            self.connector.send_control(peer, wire.Draining("ffn rank shutting down"))
            self._told_draining.add(peer)
            log.info("told attention peer attn-%d that this rank is about to stop", self.peers[peer])

    def _next_plans(self) -> dict[bytes, wire.StepPlan]:
        """The oldest queued plan of every peer that has one: a peer's plans run one step each, in order."""
        return {peer: queue.popleft() for peer, queue in self.queued.items() if queue}

    def _gather_more(self, plans: dict[bytes, wire.StepPlan]) -> None:
        """Hold the step up to `batch_window_s` so every connected peer's rows share it."""
        deadline = time.monotonic() + self.batch_window_s
        while len(plans) < len(self.peers) and (left := deadline - time.monotonic()) > 0:
            for peer, message in self.connector.poll_control(left):
                self._on_control(peer, message)
            for peer, queue in self.queued.items():
                if queue and peer not in plans:  # a peer already in the step keeps its next plan queued
                    plans[peer] = queue.popleft()

    def run_step(self, plans: dict[bytes, wire.StepPlan]) -> None:
        """One step for every peer that sent a plan: eager, or captured/replayed as the plans say."""
        started, rows_before = time.monotonic(), self.rows_served
        profiling = any(plan.profile for plan in plans.values())
        self.clock.begin(profiling)
        self._count_bytes(plans)
        try:
            if self.graphs is None:
                self._step_body(plans)
            else:
                self.graphs.run(plans, lambda: self._step_body(plans))
            failed = self.connector.wait_step(tuple(plans))
        except ConnectorError as err:  # a transfer failed outright (NCCL saw a peer exit): drop who is gone, serve on
            failed = self.connector.fail_step(tuple(plans), str(err))
        for peer, reason in failed.items():
            self._drop(peer, reason)
        self.steps_run += 1
        if profiling and self.on_layers is not None:
            self.on_layers(self.clock.collect())
        if self.observer:
            self.observer.on_step(time.monotonic() - started, self.rows_served - rows_before)

    def _count_bytes(self, plans: dict[bytes, wire.StepPlan]) -> None:
        """Bytes the step moves, from its plans (also right when a graph replays it)."""
        rows = sum(sum(plan.stage_tokens) for plan in plans.values())
        element = DTYPES[self.expected.dtype].itemsize
        per_row = len(self.crossing) * self.expected.hidden_size * element
        self.transfer_bytes["recv"] += rows * (per_row + len(self.crossing) * 4 * self.expected.router_width)
        self.transfer_bytes["send"] += rows * per_row

    def _step_body(self, plans: dict[bytes, wire.StepPlan]) -> None:
        """All crossing layers × stages for the peers in `plans`; capturable with the NCCL data plane."""
        live = dict(sorted(plans.items()))
        for layer in self.crossing:
            for stage in range(self.expected.stages):
                peers = tuple(p for p, plan in live.items() if plan.stage_tokens[stage] > 0)
                if not peers:
                    continue
                transfer = FFNTransfer(
                    layer, stage, peers, tuple(live[p].step_id for p in peers), tuple(live[p].stage_tokens[stage] for p in peers)
                )
                clock = self.clock
                waiting = clock.now()
                delivered, hidden, logits = self.connector.recv_attn_output(transfer)
                clock.lap("recv", layer, waiting)
                for peer, reason in self.connector.failed_peers.items():
                    live.pop(peer, None)
                    self._drop(peer, reason)
                if delivered.peers:
                    computing = clock.now()
                    output = self._compute(layer, hidden, logits)
                    clock.lap("compute", layer, computing)
                    sending = clock.now()
                    self.connector.send_ffn_output(output, delivered)
                    clock.lap("send", layer, sending)
                    self.rows_served += hidden.shape[0]
        self.connector.end_step()

    def _compute(self, layer_index: int, hidden: torch.Tensor, router_logits: torch.Tensor | None) -> torch.Tensor:
        layer = self.layers[layer_index]
        if router_logits is not None:
            return layer.expert_half(hidden, router_logits)
        return layer.ffn_half(hidden)

    def _on_control(self, peer: bytes, message: object) -> None:
        if isinstance(message, wire.Hello):
            self._on_hello(peer, message)
        elif isinstance(message, wire.StepPlan):
            problem = self._check_plan(peer, message)
            if problem:
                self._drop(peer, problem)
            else:  # a peer may run ahead by several plans (graph warm-up and capture): none is lost
                self.last_plan_at = time.monotonic()
                self.queued.setdefault(peer, deque()).append(message)
        elif isinstance(message, wire.Heartbeat):
            if peer in self.peers:
                self.connector.send_control(peer, message)
        elif isinstance(message, wire.Goodbye):
            rank = self._forget(peer)
            self.connector.forget_peer(peer, graceful=True)  # its pair's NCCL end goes too, as the peer closes its own
            if rank is not None:
                log.info("attention peer attn-%d left: %s (connection %s)", rank, message.reason, show(peer))
        elif isinstance(message, wire.ProtocolVersionError):
            self.connector.send_control(peer, wire.HelloReply(False, self.ffn_rank, str(message)))
            log.warning("refused %s: %s", show(peer), message)
        elif isinstance(message, wire.ProtocolError):
            self.connector.rejected["control"] += 1
            log.warning("rejected a control message from %s: %s", show(peer), message)

    def _on_hello(self, peer: bytes, hello: wire.Hello) -> None:
        if peer in self.replies:  # the same connection asking again (Hellos queued while this rank was down)
            self.connector.send_control(peer, self.replies[peer])
            return
        reason = check_hello(hello, self.expected, self.served_ranks)
        if reason is None:
            reason = check_identity(peer, hello.attention_rank, self.identity_key)
        if reason is None and peer in self.retired:
            reason = f"connection identity {show(peer)} was closed before (a replayed Hello?)"
        if reason:
            self.handshake_failures += 1
            log.error("refused attention peer %s: %s", show(peer), reason)
            self.connector.send_control(peer, wire.HelloReply(False, self.ffn_rank, reason))
            return
        for old, rank in list(self.peers.items()):
            if rank == hello.attention_rank:  # the rank restarted or re-handshakes: its earlier connection is void
                self._drop(old, f"attention rank {rank} reconnected as {show(peer)}")
        self.peers[peer] = hello.attention_rank
        self.queued.pop(peer, None)
        extra = self.connector.accept_peer(peer)
        self._notify_peer(hello.attention_rank, True)
        log.info("attention rank %d connected (connection %s)", hello.attention_rank, show(peer))
        self.replies[peer] = wire.HelloReply(True, self.ffn_rank, **extra)
        self.connector.send_control(peer, self.replies[peer])

    def _check_plan(self, peer: bytes, plan: wire.StepPlan) -> str | None:
        if peer not in self.peers:
            return "step plan before a completed handshake"
        if len(plan.stage_tokens) != self.expected.stages or min(plan.stage_tokens) < 0:
            return f"step plan with stage tokens {list(plan.stage_tokens)} for {self.expected.stages} stage(s)"
        return None

    def _notify_peer(self, rank: int, up: bool) -> None:
        if self.observer:
            self.observer.on_peer(rank, up)

    def _probe_peers(self) -> None:
        """Drop the peers whose connection closed (a killed process) even when they have no step running."""
        for peer in list(self.peers):
            if (reason := self.connector.peer_problem(peer)) is not None:
                self._drop(peer, reason)

    def _drop(self, peer: bytes, reason: str) -> None:
        """Forget `peer` and tell it why (a connection never handshaken is logged once)."""
        known = peer in self.peers or peer not in self.retired
        rank = self._forget(peer)
        if known:
            who = f"attn-{rank} (connection {show(peer)})" if rank is not None else show(peer)
            log.warning("dropping attention peer %s: %s", who, reason)
        self.connector.drop_peer(peer, reason)

    def _forget(self, peer: bytes) -> int | None:
        """Everything this runner holds for `peer` goes; returns its rank if it was connected."""
        rank = self.peers.pop(peer, None)
        self.queued.pop(peer, None)
        self.replies.pop(peer, None)
        if self.graphs is not None:
            self.graphs.forget(peer)
        self.retired[peer] = None
        while len(self.retired) > MAX_RETIRED:
            del self.retired[next(iter(self.retired))]
        if rank is not None:
            self._notify_peer(rank, False)
        return rank
