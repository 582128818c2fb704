"""Attention-role connector: handshake, step plans, and per-layer send/receive to one FFN rank."""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from afd.connector import wire
from afd.connector.base import AttnTransfer, ConnectorError, HandshakeError, PeerLost
from afd.connector.tensors import DTYPE_NAMES, from_frame, to_frame
from afd.connector.transport import PeerTransport

log = logging.getLogger(__name__)
_HELLO_RETRY_S = 1.0


class AttentionConnector:
    """Talks to the FFN rank serving this attention rank (the role-shaped API of docs/architecture.md)."""

    def __init__(self, transport: PeerTransport, ffn_rank: int, device: torch.device | str, peer_timeout_s: float):
        self.transport = transport
        self.ffn_rank = ffn_rank
        self.device = device
        self.peer_timeout_s = peer_timeout_s
        self._stash: dict[tuple[int, int, int], torch.Tensor] = {}
        self._step_id = -1
        self.heartbeat_interval_s = 1.0
        self.reopen: Callable[[], PeerTransport] | None = None  # set by the factory when the link can be rebuilt
        self._hello: wire.Hello | None = None
        self._beats = 0
        self._last_beat = self._last_heard = time.monotonic()
        self.ffn_draining: str | None = None  # the FFN rank said it is about to stop (wire.Draining)

    def handshake(self, hello: wire.Hello, timeout_s: float) -> wire.HelloReply:
        """Send Hello until the FFN answers; raise `HandshakeError` on refusal or silence."""
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
                    self._hello, self._last_heard = hello, time.monotonic()
                    self.ffn_draining = None
                    return reply
        raise HandshakeError(f"ffn rank {self.ffn_rank} did not answer the handshake within {timeout_s:.0f} s")

    def send_plan(self, plan: wire.StepPlan) -> None:
        self._step_id = plan.step_id
        self._stash = {key: value for key, value in self._stash.items() if key[0] >= plan.step_id}
        self.transport.send("control", [wire.encode(plan)])

    def send_heartbeat(self, seq: int) -> None:
        self.transport.send("control", [wire.encode(wire.Heartbeat(seq))])

    def keepalive(self) -> None:
        """Between steps: heartbeat when due; `PeerLost` if the FFN went silent or said goodbye."""
        self.tick()
        silent = time.monotonic() - self._last_heard
        if silent > self.peer_timeout_s:
            raise PeerLost(f"ffn rank {self.ffn_rank} has not answered a heartbeat for {silent:.1f} s")

    def tick(self) -> None:
        """Heartbeat when due and take what the FFN sent; `PeerLost` on a Goodbye or a closed connection.

        Also called while a step waits on the GPU (NCCL), so a waiting rank still
        heartbeats and the FFN can tell it from a dead one.
        """
        now = time.monotonic()
        if now - self._last_beat >= self.heartbeat_interval_s:
            self._beats += 1
            self.send_heartbeat(self._beats)
            self._last_beat = now
        while (received := self.transport.recv(0)) is not None:
            self._on_message(*received)

    def reconnect(self, timeout_s: float) -> wire.HelloReply:
        """Rebuild the link on a new connection (fresh sockets, fresh identity) and repeat the handshake."""
        if self.reopen is None or self._hello is None:
            raise ConnectorError(f"this connector cannot reconnect to ffn rank {self.ffn_rank} in-process")
        self.abandon()
        self.transport.close()
        self.transport = self.reopen()
        self._stash.clear()
        self._last_beat = time.monotonic()
        return self.handshake(self._hello, timeout_s)

    def abandon(self) -> None:
        """Drop what the lost link still holds (nothing for host transports; NCCL aborts its pair)."""

    def send_attn_output(
        self, hidden: torch.Tensor, transfer: AttnTransfer, router_logits: torch.Tensor | None = None
    ) -> None:
        """Ship [tokens, hidden] (and [tokens, experts] float32 router logits) for one layer and stage."""
        header = wire.DataHeader(
            step_id=transfer.step_id,
            layer=transfer.layer,
            stage=transfer.stage,
            rows=hidden.shape[0],
            cols=hidden.shape[1],
            dtype=DTYPE_NAMES[hidden.dtype],
            logit_cols=0 if router_logits is None else router_logits.shape[1],
        )
        frames = [wire.encode(header), to_frame(hidden)]
        if router_logits is not None:
            frames.append(to_frame(router_logits.float()))
        self.transport.send("data", frames)

    def recv_ffn_output(self, transfer: AttnTransfer) -> torch.Tensor:
        """Block until the FFN output of `transfer` arrives (at most the peer timeout)."""
        key = (transfer.step_id, transfer.layer, transfer.stage)
        deadline = time.monotonic() + self.peer_timeout_s
        while key not in self._stash:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerLost(f"ffn rank {self.ffn_rank} sent no output for layer {transfer.layer} "
                               f"stage {transfer.stage} within {self.peer_timeout_s:.0f} s")
            received = self.transport.recv(left)
            if received is not None:
                self._on_message(*received)
        return self._stash.pop(key)

    def wait_step(self) -> None:
        """Block until this step's transfers are done (a no-op: host transfers already are)."""

    def close(self, reason: str = "shutdown") -> None:
        try:
            self.transport.send("control", [wire.encode(wire.Goodbye(reason))])
        finally:
            self.transport.close()

    def _on_message(self, plane: str, frames: list[bytes]) -> None:
        if plane == "down":
            raise PeerLost(f"ffn rank {self.ffn_rank} is gone: {frames[0].decode(errors='replace')}")
        self._last_heard = time.monotonic()
        if plane == "control":
            message = self._decode_control(frames)
            if isinstance(message, wire.Goodbye):
                raise PeerLost(f"ffn rank {self.ffn_rank} closed the link: {message.reason}")
            if isinstance(message, wire.Draining) and self.ffn_draining is None:
                log.warning("ffn rank %d is about to stop (%s): unready, finishing the running requests",
                            self.ffn_rank, message.reason)
                self.ffn_draining = f"ffn rank {self.ffn_rank} is about to stop: {message.reason}"
            return
        header = wire.decode(frames[0])
        if not isinstance(header, wire.DataHeader) or len(frames) != 2:
            raise PeerLost(f"ffn rank {self.ffn_rank} sent a malformed data message")
        if header.step_id < self._step_id:
            return  # a late reply to an abandoned step
        tensor = from_frame(frames[1], header.rows, header.cols, header.dtype, self.device)
        self._stash[(header.step_id, header.layer, header.stage)] = tensor

    def _decode_control(self, frames: list[bytes]):
        try:
            return wire.decode(frames[0])
        except wire.ProtocolError as err:
            log.warning("ignoring a control message from ffn rank %d: %s", self.ffn_rank, err)
            return None
