"""The FFN side of the link: the control handler of one FFN rank's attention peers.

One receive loop reads both planes: control messages are handled here (Hello, StepPlan,
Heartbeat, Goodbye, ShardHello), data frames go to the `FFNPlane`. Who is connected (and which
identities were retired) is the `PeerTable` (`afd.connector.peers`); this handler keeps the plans
queued per peer, the drain notice, the probes of idle peers and the shard followers; the worker
loop (`afd.runners.ffn_worker`) only asks for the next plans and drops the peers a step reports failed.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from contextlib import contextmanager
from typing import Callable

from afd.connector import wire
from afd.connector.hello_check import check_hello
from afd.connector.identity import check_identity, show
from afd.connector.peers import PeerTable
from afd.connector.plane import FFNPlane
from afd.connector.transport import ServerTransport

log = logging.getLogger(__name__)
DRAIN_NOTICE_S = 5.0  # after the notice, attention pods need this long to leave every proxy's endpoints
DRAIN_QUIET_S = 3.0  # or no step running or begun for this long (peers that never leave): their requests have finished


class FFNLink:
    """Serves the control plane of one FFN rank; `plane` moves the tensors."""

    def __init__(self, transport: ServerTransport, plane: FFNPlane, expected: wire.Hello, served_ranks: tuple[int, ...],
                 ffn_rank: int, identity_key: bytes):
        self.transport, self.plane = transport, plane
        self.expected, self.served_ranks, self.ffn_rank = expected, served_ranks, ffn_rank
        self.identity_key = identity_key  # proves a connection identity was made by the group (afd.connector.identity)
        self.table = PeerTable()
        self.queued: dict[bytes, deque[wire.StepPlan]] = {}  # plans received, not yet run, per peer
        self.rejected: Counter[str] = Counter()
        self.handshake_failures = 0
        self.drain_started: float | None = None  # monotonic time of request_drain()
        self.last_active_at = 0.0  # monotonic time of the last plan received or step ended (the drain's quiet time)
        self._steps_running = 0  # steps the worker runs now (`running_step`)
        self._control: deque[tuple[bytes, object]] = deque()
        self._told_draining: set[bytes] = set()
        self.followers: dict[bytes, int] = {}  # shard 0 of an expert-parallel rank: the other shards' connections
        self._peer_watchers: list[Callable[[int, bool], None]] = []
        self._gone_watchers: list[Callable[[bytes], None]] = []

    @property
    def peers(self) -> dict[bytes, int]:
        """The connected peers: connection identity → attention rank."""
        return self.table.ranks

    def watch_peers(self, on_peer: Callable[[int, bool], None]) -> None:
        """`on_peer(attention_rank, up)` on every connect and loss (metrics)."""
        self._peer_watchers.append(on_peer)

    def watch_gone(self, on_gone: Callable[[bytes], None]) -> None:
        """`on_gone(peer)` when a connection goes (state keyed by it, e.g. step graphs, goes too)."""
        self._gone_watchers.append(on_gone)

    # -- the worker's calls ----------------------------------------------------
    def poll(self, timeout_s: float) -> None:
        """Handle the control messages that came, waiting up to `timeout_s` for one."""
        deadline = time.monotonic() + timeout_s
        while not self._control and (left := deadline - time.monotonic()) > 0:
            self.pump(left)
        while self._control and self.pump(0.0):
            pass  # take every plan already here, so peers that arrive together share one step
        while self._control:
            self.handle(*self._control.popleft())

    def next_plans(self) -> dict[bytes, wire.StepPlan]:
        """The oldest queued plan of every peer that has one: a peer's plans run one step each, in order."""
        return {peer: queue.popleft() for peer, queue in self.queued.items() if queue}

    def gather_more(self, plans: dict[bytes, wire.StepPlan], window_s: float) -> None:
        """Hold the step up to `window_s` so every connected peer's rows share it."""
        deadline = time.monotonic() + window_s
        while len(plans) < len(self.peers) and (left := deadline - time.monotonic()) > 0:
            self.poll(left)
            for peer, queue in self.queued.items():
                if queue and peer not in plans:  # a peer already in the step keeps its next plan queued
                    plans[peer] = queue.popleft()

    def has_plans(self) -> bool:
        return any(self.queued.values())

    def probe(self) -> None:
        """Drop the peers whose connection closed (a killed process) even when they have no step running."""
        for peer in list(self.peers):
            if (reason := self.peer_problem(peer)) is not None:
                self.drop(peer, reason)

    def drop(self, peer: bytes, reason: str) -> None:
        """Forget `peer` and tell it why, so it fails fast (a connection never handshaken is logged once)."""
        known = peer in self.table or peer not in self.table.retired
        rank = self._forget(peer, graceful=False)
        if known:
            who = f"attn-{rank} (connection {show(peer)})" if rank is not None else show(peer)
            log.warning("dropping attention peer %s: %s", who, reason)
        self.send_control(peer, wire.Goodbye(reason))

    def request_drain(self) -> None:
        """Any thread (the preStop hook): tell every attention peer this rank is about to stop."""
        if self.drain_started is None:
            self.drain_started = time.monotonic()

    def tell_draining(self) -> None:
        if self.drain_started is None:
            return
        for peer in [p for p in self.peers if p not in self._told_draining]:
            self.send_control(peer, wire.Draining("ffn rank shutting down"))
            self._told_draining.add(peer)
            log.info("told attention peer attn-%d that this rank is about to stop", self.peers[peer])

    def drained(self) -> bool:
        """Nothing left to serve: every peer has left (an attention rank leaves once it has finished
        what it ran after the notice), or since the notice had time to take effect no step has run or
        begun for a while (a step running however long, as on a starved CPU, is never quiet)."""
        if not self.peers:
            return True
        if self.drain_started is None or self._steps_running:
            return False
        now = time.monotonic()
        return now - self.drain_started >= DRAIN_NOTICE_S and now - self.last_active_at >= DRAIN_QUIET_S

    @contextmanager
    def running_step(self):
        """Around one step of the worker: the drain's quiet time counts from its end, not from its plan."""
        self._steps_running += 1
        try:
            yield
        finally:
            self._steps_running -= 1
            self.last_active_at = time.monotonic()

    def close(self) -> None:
        for peer in list(self.peers):
            self.send_control(peer, wire.Goodbye("ffn rank shutting down"))
        self.plane.close()
        self.transport.close()

    # -- PeerWatch: what a waiting data plane asks -----------------------------
    def pump(self, timeout_s: float) -> bool:
        """Take one message off the transport; False when none came within `timeout_s`."""
        received = self.transport.recv(timeout_s)
        if received is None:
            return False
        plane, peer, frames = received
        self.table.heard(peer)
        if plane == "control":
            self._control.append((peer, _decode_control(frames)))
        elif peer not in self.peers:
            self._reject(peer, "data from a peer that has not completed the handshake")
        elif (problem := self.plane.accept(peer, frames)) is not None:
            self._reject(peer, problem)
        return True

    def peer_problem(self, peer: bytes, silent_after_s: float | None = None) -> str | None:
        """Why `peer` is gone (its connection closed, or it is silent for `silent_after_s`), or None.

        The probe is a heartbeat the peer ignores: with ROUTER_MANDATORY a send to a
        connection the peer's process closed fails at once.
        """
        if not self.send_control(peer, wire.Heartbeat(0)):
            return "its connection closed (process gone?)"
        silent = self.table.silent_s(peer)
        if silent_after_s is not None and silent > silent_after_s:
            return f"silent for {silent:.1f} s"
        return None

    def send_control(self, peer: bytes, message: object) -> bool:
        return self.transport.send("control", peer, [wire.encode(message)])

    # -- control messages ------------------------------------------------------
    def handle(self, peer: bytes, message: object) -> None:
        if isinstance(message, wire.Hello):
            self._on_hello(peer, message)
        elif isinstance(message, wire.StepPlan):
            problem = self._check_plan(peer, message)
            if problem:
                self.drop(peer, problem)
            else:  # a peer may run ahead by several plans (graph warm-up and capture): none is lost
                self.last_active_at = time.monotonic()
                self.queued.setdefault(peer, deque()).append(message)
        elif isinstance(message, wire.Heartbeat):
            if peer in self.peers:
                self.send_control(peer, message)
        elif isinstance(message, wire.Goodbye):
            rank = self._forget(peer, graceful=True)  # its pair's NCCL end goes too, as the peer closes its own
            if rank is not None:
                log.info("attention peer attn-%d left: %s (connection %s)", rank, message.reason, show(peer))
        elif isinstance(message, wire.ShardHello):
            self._on_shard_hello(peer, message)
        elif isinstance(message, wire.ProtocolVersionError):
            self.send_control(peer, wire.HelloReply(False, self.ffn_rank, str(message)))
            log.warning("refused %s: %s", show(peer), message)
        elif isinstance(message, wire.ProtocolError):
            self.rejected["control"] += 1
            log.warning("rejected a control message from %s: %s", show(peer), message)

    def _on_hello(self, peer: bytes, hello: wire.Hello) -> None:
        if peer in self.table.replies:  # the same connection asking again (Hellos queued while this rank was down)
            self.send_control(peer, self.table.replies[peer])
            return
        reason = check_hello(hello, self.expected, self.served_ranks)
        if reason is None:
            reason = check_identity(peer, hello.attention_rank, self.identity_key)
        if reason is None and peer in self.table.retired:
            reason = f"connection identity {show(peer)} was closed before (a replayed Hello?)"
        if reason is None and self.drain_started is not None:  # a peer that left after the notice must not come back
            reason = f"ffn rank {self.ffn_rank} is about to stop (draining)"
        if reason:
            self.handshake_failures += 1
            log.error("refused attention peer %s: %s", show(peer), reason)
            self.send_control(peer, wire.HelloReply(False, self.ffn_rank, reason))
            return
        for old in self.table.connections_of(hello.attention_rank):  # it restarted or re-handshakes: the old is void
            self.drop(old, f"attention rank {hello.attention_rank} reconnected as {show(peer)}")
        self.table.add(peer, hello.attention_rank)
        self.queued.pop(peer, None)
        extra = self.plane.admit(peer)
        for on_peer in self._peer_watchers:
            on_peer(hello.attention_rank, True)
        log.info("attention rank %d connected (connection %s)", hello.attention_rank, show(peer))
        self.table.replies[peer] = wire.HelloReply(True, self.ffn_rank, **extra)
        self.send_control(peer, self.table.replies[peer])

    def _on_shard_hello(self, peer: bytes, hello: wire.ShardHello) -> None:
        """Another shard of this rank asks for the step orders (`afd.runners.step_order`)."""
        ours = self.expected
        if hello.token_digest != ours.token_digest or ours.ffn_shard != 0 or \
                hello.expert_parallel != ours.expert_parallel or not 0 < hello.shard < ours.expert_parallel:
            if peer not in self.table.retired:
                log.error("refused shard connection %s: shard %d of %d (this is shard %d of %d, or the group token differs)",
                          show(peer), hello.shard, hello.expert_parallel, ours.ffn_shard, ours.expert_parallel)
                self.table.retire(peer)  # logged once
            return
        for old, shard in list(self.followers.items()):
            if shard == hello.shard and old != peer:
                del self.followers[old]
        if peer not in self.followers:
            log.info("shard %d of ffn rank %d follows this shard's step orders", hello.shard, self.ffn_rank)
        self.followers[peer] = hello.shard

    def _check_plan(self, peer: bytes, plan: wire.StepPlan) -> str | None:
        if peer not in self.peers:
            return "step plan before a completed handshake"
        if len(plan.stage_tokens) != self.expected.stages or min(plan.stage_tokens) < 0:
            return f"step plan with stage tokens {list(plan.stage_tokens)} for {self.expected.stages} stage(s)"
        return None

    def _forget(self, peer: bytes, graceful: bool) -> int | None:
        """Everything held for `peer` goes; returns its rank if it was connected."""
        rank = self.table.remove(peer)
        self.queued.pop(peer, None)
        for on_gone in self._gone_watchers:  # graphs replaying its transfers go before its NCCL pair
            on_gone(peer)
        self.plane.forget(peer, graceful)
        if rank is not None:
            for on_peer in self._peer_watchers:
                on_peer(rank, False)
        return rank

    def _reject(self, peer: bytes, reason: str) -> None:
        self.rejected[reason.split(":")[0][:40]] += 1
        log.warning("rejected a data message from %s: %s", show(peer), reason)


def _decode_control(frames: list[bytes]) -> object:
    if len(frames) != 1:
        return wire.ProtocolError(f"control message with {len(frames)} frames (expected 1)")
    try:
        return wire.decode(frames[0])
    except wire.ProtocolError as err:
        return err
