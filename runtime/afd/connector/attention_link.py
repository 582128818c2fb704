"""The attention side of the link to one FFN rank: handshake, step plans, heartbeats, reconnect.

One object per attention process, used alike by our engine, the vLLM plugin and the
benchmarks. It owns the control plane (`afd.connector.wire` over a `PeerTransport`)
and one `AttentionPlane` that moves the step's tensors. `AttentionLink.connect` is the
one connect-and-handshake; `keepalive` and `recover` are all an engine calls between steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from afd.config import GroupSettings, LinkSettings
from afd.connector import registry, wire
from afd.connector.base import AttnTransfer, HandshakeError, PeerLeft, PeerLost
from afd.connector.plane import AttentionPlane, PlaneOptions
from afd.connector.transport import PeerTransport

log = logging.getLogger(__name__)
_HELLO_RETRY_S = 1.0
LEAVE_AFTER_NOTICE_S = 2.0  # after an FFN's drain notice, time for this rank to leave every proxy's endpoints


@dataclass(frozen=True)
class LinkOptions:
    """Timings of one link, fixed at construction."""

    peer_timeout_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    connect_timeout_s: float = 30.0
    reconnect_timeout_s: float = 5.0

    @classmethod
    def of(cls, link: LinkSettings, reconnect_timeout_s: float = 5.0) -> "LinkOptions":
        return cls(link.peer_timeout_s, link.heartbeat_interval_s, link.connect_timeout_s, reconnect_timeout_s)


class LinkListener(Protocol):
    """Told around a re-handshake: state bound to the old connection goes, then is rebuilt."""

    def on_link_lost(self) -> None: ...

    def on_link_back(self) -> None: ...


class AttentionLink:
    """The handshaken connection of one attention rank to the FFN rank that serves it."""

    shards = 1  # the FFN rank is one process (`ShardedLink` has one link per expert shard)

    def __init__(self, ffn_rank: int, open_transport: Callable[[], PeerTransport], plane: AttentionPlane,
                 options: LinkOptions):
        self.ffn_rank = ffn_rank
        self.options = options
        self._open = open_transport  # every connection, the first and each reconnect, has a fresh identity
        self.transport = open_transport()
        self.plane = plane
        self.step_id = -1
        self.ffn_draining: str | None = None  # the FFN rank said it is about to stop (wire.Draining)
        self._draining_since = 0.0
        self.recover_attempts = self.recover_failures = 0  # afd_peer_reconnect_failures_total
        self._hello: wire.Hello | None = None
        self._listeners: list[LinkListener] = []
        self._beats = 0
        self._last_beat = self._last_heard = time.monotonic()

    @classmethod
    def open(cls, group: GroupSettings, settings: LinkSettings, device: torch.device | str,
             options: LinkOptions | None = None, shard: int = 0) -> "AttentionLink":
        """Attention rank `group.rank`'s link to (shard `shard` of) its FFN rank, over `settings.connector`;
        not handshaken yet."""
        transport = registry.transport(settings.connector)
        ffn_rank = group.topology.ffn_rank_of(group.rank)
        endpoint = group.ffn_endpoint(ffn_rank, shard)
        options = options or LinkOptions.of(settings)
        plane = transport.attention_plane(PlaneOptions(device, options.peer_timeout_s))
        return cls(ffn_rank, lambda: transport.open_peer(settings, endpoint, registry.peer_identity(group)), plane,
                   options)

    @classmethod
    def connect(cls, group: GroupSettings, settings: LinkSettings, hello: wire.Hello, device: torch.device | str,
                options: LinkOptions | None = None, shard: int = 0) -> "AttentionLink":
        """Open and handshake (raises `HandshakeError`; nothing is left open then)."""
        link = cls.open(group, settings, device, options, shard)
        try:
            link.handshake(hello)
        except Exception:
            link.plane.abort()
            link.transport.close()
            raise
        return link

    @property
    def identity(self) -> bytes:
        return self.transport.identity

    def listen(self, listener: LinkListener) -> None:
        self._listeners.append(listener)

    # -- control plane ---------------------------------------------------------
    def handshake(self, hello: wire.Hello, timeout_s: float | None = None) -> wire.HelloReply:
        """Send Hello until the FFN answers; raise `HandshakeError` on refusal or silence."""
        timeout_s = self.options.connect_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.transport.send("control", [wire.encode(hello)])
            retry_at = min(deadline, time.monotonic() + _HELLO_RETRY_S)
            while (left := retry_at - time.monotonic()) > 0:
                received = self.transport.recv(left)
                if received is None or received[0] != "control":
                    continue
                reply = self._decode_control(received[1])
                if isinstance(reply, wire.HelloReply):
                    if not reply.accepted:
                        raise HandshakeError(f"ffn rank {self.ffn_rank} refused the connection: {reply.reason}")
                    self._hello, self._last_heard, self.ffn_draining = hello, time.monotonic(), None
                    self.plane.bind(self.transport, reply, self._pump, timeout_s)
                    return reply
        raise HandshakeError(f"ffn rank {self.ffn_rank} did not answer the handshake within {timeout_s:.0f} s")

    def send_plan(self, plan: wire.StepPlan) -> None:
        self.step_id = plan.step_id
        self.plane.begin_step(plan.step_id)
        self.transport.send("control", [wire.encode(plan)])

    def tick(self) -> None:
        """Heartbeat when due and take what the FFN sent; `PeerLost` on a Goodbye or a closed connection.

        Also called while a step waits on the GPU, so a waiting rank still heartbeats.
        """
        now = time.monotonic()
        if now - self._last_beat >= self.options.heartbeat_interval_s:
            self._beats += 1
            self.transport.send("control", [wire.encode(wire.Heartbeat(self._beats))])
            self._last_beat = now
        while self._pump(0):
            pass

    def keepalive(self) -> None:
        """Between steps: heartbeat when due; `PeerLost` if the FFN went silent or said goodbye."""
        self.tick()
        silent = time.monotonic() - self._last_heard
        if silent > self.options.peer_timeout_s:
            raise PeerLost(f"ffn rank {self.ffn_rank} has not answered a heartbeat for {silent:.1f} s")

    def recover(self) -> None:
        """Re-handshake with a returned FFN rank on a new connection (fresh identity); counted and logged.

        The data plane drops the old connection first (NCCL aborts its pair), then the
        listeners drop and rebuild what was bound to it (the decode graphs).
        """
        if self._hello is None:
            raise HandshakeError(f"the link to ffn rank {self.ffn_rank} never completed a handshake")
        self.recover_attempts += 1
        started = time.monotonic()
        log.info("re-handshaking with ffn rank %d (attempt %d)", self.ffn_rank, self.recover_attempts)
        try:
            self.plane.abort()  # stuck transfers end and the stream drains before anything else goes
            for listener in self._listeners:
                listener.on_link_lost()
            self.transport.close()
            self.transport = self._open()
            self._last_beat = time.monotonic()
            self.handshake(self._hello, self.options.reconnect_timeout_s)
            for listener in self._listeners:
                listener.on_link_back()
        except Exception as err:
            self.recover_failures += 1
            log.info("re-handshake with ffn rank %d failed (attempt %d, %d failed so far): %s",
                     self.ffn_rank, self.recover_attempts, self.recover_failures, err)
            raise
        log.info("ffn rank %d linked again in %.1f s", self.ffn_rank, time.monotonic() - started)

    def leave_if_done(self, idle: bool) -> bool:
        """Once the FFN's drain notice has had time to take this rank out of the Service, and this
        rank runs nothing, say goodbye: the FFN's drain then ends at once instead of guessing from
        quiet time. True when it left; the caller treats the link as lost and re-handshakes with
        the FFN's successor (the draining FFN refuses to take this rank back)."""
        if self.ffn_draining is None or not idle or time.monotonic() - self._draining_since < LEAVE_AFTER_NOTICE_S:
            return False
        self.transport.send("control", [wire.encode(wire.Goodbye("attention rank done: its ffn rank is draining"))])
        log.info("left ffn rank %d: it is draining and this rank has finished its requests", self.ffn_rank)
        return True

    def close(self, reason: str = "shutdown") -> None:
        try:
            self.transport.send("control", [wire.encode(wire.Goodbye(reason))])
        finally:
            self.transport.close()
            self.plane.close()

    # -- data plane ------------------------------------------------------------
    def send(self, hidden: torch.Tensor, transfer: AttnTransfer, router_logits: torch.Tensor | None = None) -> None:
        """Ship [tokens, hidden] (and [tokens, experts] float32 router logits) for one layer and stage."""
        self.plane.send(hidden, transfer, router_logits)

    def recv(self, transfer: AttnTransfer) -> torch.Tensor:
        """The FFN output of `transfer`; `PeerLost` past the peer timeout."""
        try:
            return self.plane.recv(transfer)
        except PeerLost as err:
            raise self._named(err) from None

    def _named(self, err: PeerLost) -> PeerLost:
        """`err` naming the FFN rank (the data plane does not know it)."""
        text = str(err)
        return err if text.startswith(f"ffn rank {self.ffn_rank}") else type(err)(f"ffn rank {self.ffn_rank}: {text}")

    def end_step(self) -> object | None:
        """Mark the end of the step just launched, for `wait_step`: the host may prepare the next one meanwhile."""
        return self.plane.end_step()

    def wait_step(self, mark: object | None = None) -> None:
        """Return once the step of `mark` (every step launched so far when None) is done, heartbeating
        meanwhile; `PeerLost` when the FFN is lost, or was lost before that step finished."""
        try:
            self.plane.finish_step(mark, self.tick)
        except PeerLost as err:
            raise self._named(err) from None

    # -- receive ---------------------------------------------------------------
    def _pump(self, timeout_s: float) -> bool:
        """Take one message off the connection; False when none came within `timeout_s`."""
        received = self.transport.recv(timeout_s)
        if received is None:
            return False
        plane, frames = received
        if plane == "down":
            raise PeerLost(f"ffn rank {self.ffn_rank} is gone: {frames[0].decode(errors='replace')}")
        self._last_heard = time.monotonic()
        if plane == "data":
            self.plane.accept(frames)
            return True
        message = self._decode_control(frames)
        if isinstance(message, wire.Goodbye):
            raise PeerLeft(f"ffn rank {self.ffn_rank} closed the link: {message.reason}")
        if isinstance(message, wire.Draining) and self.ffn_draining is None:
            log.warning("ffn rank %d is about to stop (%s): unready, finishing the running requests",
                        self.ffn_rank, message.reason)
            self.ffn_draining = f"ffn rank {self.ffn_rank} is about to stop: {message.reason}"
            self._draining_since = time.monotonic()
        return True

    def _decode_control(self, frames: list[bytes]):
        try:
            return wire.decode(frames[0])
        except wire.ProtocolError as err:
            log.warning("ignoring a control message from ffn rank %d: %s", self.ffn_rank, err)
            return None
