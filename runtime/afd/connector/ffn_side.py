"""FFN-role connector: control messages from many peers, and per-layer gather/scatter of rows.

One receive loop reads both planes. Control messages queue for the runner; data
messages wait in a stash keyed by (peer, step, layer, stage) until the runner asks
for them, so peers may run ahead by a stage without being lost or mixed up. Every
data message is checked against the shape the step plan promised; a bad one is
rejected, counted and logged, and its sender is dropped without touching the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

import torch

from afd.connector import wire
from afd.connector.base import FFNTransfer
from afd.connector.identity import show
from afd.connector.tensors import from_frame, to_frame
from afd.connector.transport import ServerTransport

log = logging.getLogger(__name__)
MAX_STASHED_MESSAGES = 1024
WAIT_SLICE_S = 0.1


class Interrupted(Exception):
    """The runner is shutting down; raised out of a blocked receive."""


@dataclass(frozen=True)
class DataContract:
    """What every data message must look like, fixed by the handshake."""

    hidden_size: int
    dtype: str
    logit_cols: int


class FFNConnector:
    """Serves the attention peers of one FFN rank."""

    def __init__(self, transport: ServerTransport, device: torch.device | str, peer_timeout_s: float, contract: DataContract):
        self.transport = transport
        self.device = device
        self.peer_timeout_s = peer_timeout_s
        self.contract = contract
        self.rejected: Counter[str] = Counter()
        self._control: deque[tuple[bytes, object]] = deque()
        self._stash: dict[tuple[bytes, int, int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._peers: set[bytes] = set()
        self._bad_peers: dict[bytes, str] = {}
        self._heard: dict[bytes, float] = {}  # peer → when it last sent anything
        self.interrupt = threading.Event()  # set by the runner's shutdown; unblocks receives

    # -- peers -----------------------------------------------------------------
    def accept_peer(self, peer: bytes) -> dict:
        """Admit `peer`; returns extra HelloReply fields (none for host transports)."""
        self._peers.add(peer)
        self._heard[peer] = time.monotonic()
        self._bad_peers.pop(peer, None)
        self._stash = {key: value for key, value in self._stash.items() if key[0] != peer}  # a returning peer starts clean
        return {}

    def drop_peer(self, peer: bytes, reason: str) -> None:
        """Forget `peer` and tell it why, so it fails fast."""
        self.forget_peer(peer)
        self.send_control(peer, wire.Goodbye(reason))

    def forget_peer(self, peer: bytes, graceful: bool = False) -> None:
        """Forget `peer` and its stashed rows (`graceful`: it said Goodbye; else it is being dropped)."""
        self._peers.discard(peer)
        self._heard.pop(peer, None)
        self._stash = {key: value for key, value in self._stash.items() if key[0] != peer}

    def peer_problem(self, peer: bytes, silent_after_s: float | None = None) -> str | None:
        """Why `peer` is gone (its connection closed, or it is silent for `silent_after_s`), or None.

        The probe is a heartbeat the peer ignores: with ROUTER_MANDATORY a send to a
        connection the peer's process closed fails at once.
        """
        if not self.send_control(peer, wire.Heartbeat(0)):
            return "its connection closed (process gone?)"
        silent = time.monotonic() - self._heard.get(peer, time.monotonic())
        if silent_after_s is not None and silent > silent_after_s:
            return f"silent for {silent:.1f} s"
        return None

    # -- control plane ---------------------------------------------------------
    def poll_control(self, timeout_s: float) -> list[tuple[bytes, object]]:
        """Queued control messages (decoded, or a `ProtocolError`), waiting up to `timeout_s` for one."""
        deadline = time.monotonic() + timeout_s
        while not self._control and (left := deadline - time.monotonic()) > 0:
            self._pump(left)
        while self._control and self._pump(0.0):
            pass  # take every plan already here, so peers that arrive together share one step
        messages = list(self._control)
        self._control.clear()
        return messages

    def send_control(self, peer: bytes, message: object) -> bool:
        return self.transport.send("control", peer, [wire.encode(message)])

    # -- data plane ------------------------------------------------------------
    def recv_attn_output(self, transfer: FFNTransfer) -> tuple[FFNTransfer, torch.Tensor, torch.Tensor | None]:
        """Rows of every peer in `transfer`, concatenated in peer order.

        Returns the transfer narrowed to the peers that delivered in time and sent
        valid rows; the others are listed in `self.failed_peers` with a reason.
        """
        keys = {peer: (peer, step, transfer.layer, transfer.stage) for peer, step in zip(transfer.peers, transfer.steps)}
        rows = dict(zip(transfer.peers, transfer.rows))
        deadline = time.monotonic() + self.peer_timeout_s
        self.failed_peers: dict[bytes, str] = {}
        while True:
            for peer, key in keys.items():
                if peer in self._bad_peers:
                    self.failed_peers[peer] = self._bad_peers[peer]
                elif key in self._stash and (got := self._stash[key][0].shape[0]) != rows[peer]:
                    self._stash.pop(key)
                    self.failed_peers[peer] = f"sent {got} rows, its plan said {rows[peer]}"
            waiting = [p for p, key in keys.items() if key not in self._stash and p not in self.failed_peers]
            left = deadline - time.monotonic()
            if not waiting:
                break
            if left <= 0:
                for peer in waiting:
                    self.failed_peers[peer] = f"no data for layer {transfer.layer} stage {transfer.stage} within {self.peer_timeout_s:.0f} s"
                break
            if self.interrupt.is_set():
                raise Interrupted()
            self._pump(min(left, WAIT_SLICE_S))
        delivered = transfer.only({p for p in transfer.peers if p not in self.failed_peers})
        pieces = [self._stash.pop(keys[peer]) for peer in delivered.peers]
        if not pieces:
            return delivered, torch.empty(0, self.contract.hidden_size), None
        hidden = torch.cat([hidden for hidden, _ in pieces]) if len(pieces) > 1 else pieces[0][0]
        logits = None
        if self.contract.logit_cols:
            logits = torch.cat([lg for _, lg in pieces]) if len(pieces) > 1 else pieces[0][1]
        return delivered, hidden, logits

    def send_ffn_output(self, output: torch.Tensor, transfer: FFNTransfer) -> None:
        """Split [sum(rows), hidden] back into each peer's rows and return them."""
        for peer, step, piece in zip(transfer.peers, transfer.steps, output.split(list(transfer.rows))):
            header = wire.DataHeader(step, transfer.layer, transfer.stage, piece.shape[0], piece.shape[1], self.contract.dtype)
            if not self.transport.send("data", peer, [wire.encode(header), to_frame(piece)]):
                log.warning("peer %s vanished before its output of layer %d", show(peer), transfer.layer)

    def end_step(self) -> None:
        """Flush what the step still holds (a no-op: host sends leave at once)."""

    def wait_step(self, peers: tuple[bytes, ...]) -> dict[bytes, str]:
        """Block until the step's transfers are done; returns the peers that failed it, with why (none here)."""
        return {}

    def fail_step(self, peers: tuple[bytes, ...], error: str) -> dict[bytes, str]:
        """A transfer of the step raised: the peers to drop, with why (host transports: every peer of it)."""
        return {peer: f"a transfer of the step failed: {error}" for peer in peers}

    def close(self) -> None:
        self.transport.close()

    # -- receive loop ----------------------------------------------------------
    def _pump(self, timeout_s: float) -> bool:
        """Take one message off the transport; False when none came within `timeout_s`."""
        received = self.transport.recv(timeout_s)
        if received is None:
            return False
        plane, peer, frames = received
        if peer in self._heard:
            self._heard[peer] = time.monotonic()
        if plane == "control":
            self._control.append((peer, self._decode_control(frames)))
            return True
        try:
            self._accept_data(peer, frames)
        except wire.ProtocolError as err:
            self._reject(peer, str(err))
        return True

    def _decode_control(self, frames: list[bytes]) -> object:
        if len(frames) != 1:
            return wire.ProtocolError(f"control message with {len(frames)} frames (expected 1)")
        try:
            return wire.decode(frames[0])
        except wire.ProtocolError as err:
            return err

    def _accept_data(self, peer: bytes, frames: list[bytes]) -> None:
        if peer not in self._peers:
            raise wire.ProtocolError("data from a peer that has not completed the handshake")
        header = wire.decode(frames[0])
        contract = self.contract
        if not isinstance(header, wire.DataHeader):
            raise wire.ProtocolError(f"expected a data header, got {type(header).__name__}")
        if header.cols != contract.hidden_size or header.dtype != contract.dtype:
            raise wire.ProtocolError(
                f"rows of {header.cols} x {header.dtype}, expected {contract.hidden_size} x {contract.dtype}"
            )
        if header.logit_cols != contract.logit_cols or len(frames) != (3 if contract.logit_cols else 2):
            raise wire.ProtocolError(f"router logits of width {header.logit_cols}, expected {contract.logit_cols}")
        hidden = from_frame(frames[1], header.rows, header.cols, header.dtype, self.device)
        logits = None
        if contract.logit_cols:
            logits = from_frame(frames[2], header.rows, header.logit_cols, "float32", self.device)
        if len(self._stash) >= MAX_STASHED_MESSAGES:
            raise wire.ProtocolError(f"more than {MAX_STASHED_MESSAGES} unclaimed data messages")
        self._stash[(peer, header.step_id, header.layer, header.stage)] = (hidden, logits)

    def _reject(self, peer: bytes, reason: str) -> None:
        self.rejected[reason.split(":")[0][:40]] += 1
        log.warning("rejected a data message from %s: %s", show(peer), reason)
        if peer in self._peers:
            self._bad_peers[peer] = f"sent an invalid data message: {reason}"
