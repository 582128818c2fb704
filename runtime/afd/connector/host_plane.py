"""The host data plane: a header frame plus raw tensor frames on the link's own transport (zmq, loopback).

Rows wait in a stash keyed by (step, layer, stage) on attention and by (peer, step, layer,
stage) on the FFN until asked for, so peers may run ahead by a stage without being lost
or mixed up. Every FFN-side message is checked against the handshake's `DataContract`; a
bad one is rejected and its sender fails its next receive, the others untouched.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from afd.connector import wire
from afd.connector.base import AttnTransfer, FFNTransfer, PeerLost
from afd.connector.identity import show
from afd.connector.plane import AttentionPlane, DataContract, FFNPlane, Interrupted, PeerWatch, PlaneOptions, Received
from afd.connector.tensors import DTYPE_NAMES, from_frame, to_frame
from afd.connector.transport import PeerTransport, ServerTransport
from afd.connector.wire import HelloReply

log = logging.getLogger(__name__)
MAX_STASHED_MESSAGES = 1024
WAIT_SLICE_S = 0.1


class HostAttentionPlane(AttentionPlane):
    def __init__(self, options: PlaneOptions):
        self.options = options
        self._transport: PeerTransport | None = None
        self._pump: Callable[[float], None] = lambda timeout_s: None
        self._stash: dict[tuple[int, int, int], torch.Tensor] = {}
        self._step_id = -1

    def bind(self, transport: PeerTransport, reply: HelloReply, pump: Callable[[float], None], timeout_s: float) -> None:
        self._transport, self._pump = transport, pump
        self._stash.clear()

    def begin_step(self, step_id: int) -> None:
        self._step_id = step_id
        self._stash = {key: value for key, value in self._stash.items() if key[0] >= step_id}

    def accept(self, frames: list[bytes]) -> None:
        header = wire.decode(frames[0])
        if not isinstance(header, wire.DataHeader) or len(frames) != 2:
            raise PeerLost("the ffn rank sent a malformed data message")
        if header.step_id < self._step_id:
            return  # a late reply to an abandoned step
        tensor = from_frame(frames[1], header.rows, header.cols, header.dtype, self.options.device)
        self._stash[(header.step_id, header.layer, header.stage)] = tensor

    def send(self, hidden: torch.Tensor, transfer: AttnTransfer, router_logits: torch.Tensor | None) -> None:
        header = wire.DataHeader(
            step_id=transfer.step_id, layer=transfer.layer, stage=transfer.stage, rows=hidden.shape[0],
            cols=hidden.shape[1], dtype=DTYPE_NAMES[hidden.dtype],
            logit_cols=0 if router_logits is None else router_logits.shape[1],
        )
        frames = [wire.encode(header), to_frame(hidden)]
        if router_logits is not None:
            frames.append(to_frame(router_logits.float()))
        self._transport.send("data", frames)

    def recv(self, transfer: AttnTransfer) -> torch.Tensor:
        key = (transfer.step_id, transfer.layer, transfer.stage)
        timeout_s = self.options.peer_timeout_s
        deadline = time.monotonic() + timeout_s
        while key not in self._stash:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerLost(f"no output for layer {transfer.layer} stage {transfer.stage} within {timeout_s:.0f} s")
            self._pump(left)
        return self._stash.pop(key)

    def end_step(self) -> None:
        return None  # host transfers are done when `recv` returns: nothing is left to wait for

    def finish_step(self, mark: None, tick: Callable[[], None]) -> None:
        pass

    def abort(self) -> None:
        self._stash.clear()

    def close(self) -> None:
        self._stash.clear()


class HostFFNPlane(FFNPlane):
    def __init__(self, options: PlaneOptions, contract: DataContract, transport: ServerTransport):
        self.options, self.contract, self.transport = options, contract, transport
        self._stash: dict[tuple[bytes, int, int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._bad: dict[bytes, str] = {}

    def admit(self, peer: bytes) -> dict:
        self.forget(peer, graceful=False)  # a returning peer starts clean
        return {}

    def forget(self, peer: bytes, graceful: bool) -> None:
        self._bad.pop(peer, None)
        self._stash = {key: value for key, value in self._stash.items() if key[0] != peer}

    def accept(self, peer: bytes, frames: list[bytes]) -> str | None:
        try:
            self._accept(peer, frames)
            return None
        except wire.ProtocolError as err:
            self._bad[peer] = f"sent an invalid data message: {err}"
            return str(err)

    def _accept(self, peer: bytes, frames: list[bytes]) -> None:
        header, contract = wire.decode(frames[0]), self.contract
        if not isinstance(header, wire.DataHeader):
            raise wire.ProtocolError(f"expected a data header, got {type(header).__name__}")
        if header.cols != contract.hidden_size or header.dtype != contract.dtype:
            raise wire.ProtocolError(f"rows of {header.cols} x {header.dtype}, expected {contract.hidden_size} x {contract.dtype}")
        if header.logit_cols != contract.logit_cols or len(frames) != (3 if contract.logit_cols else 2):
            raise wire.ProtocolError(f"router logits of width {header.logit_cols}, expected {contract.logit_cols}")
        hidden = from_frame(frames[1], header.rows, header.cols, header.dtype, self.options.device)
        logits = None
        if contract.logit_cols:
            logits = from_frame(frames[2], header.rows, header.logit_cols, "float32", self.options.device)
        if len(self._stash) >= MAX_STASHED_MESSAGES:
            raise wire.ProtocolError(f"more than {MAX_STASHED_MESSAGES} unclaimed data messages")
        self._stash[(peer, header.step_id, header.layer, header.stage)] = (hidden, logits)

    def recv(self, transfer: FFNTransfer, watch: PeerWatch, stop: Callable[[], bool]) -> Received:
        keys = {peer: (peer, step, transfer.layer, transfer.stage) for peer, step in zip(transfer.peers, transfer.steps)}
        rows = dict(zip(transfer.peers, transfer.rows))
        timeout_s = self.options.peer_timeout_s
        deadline = time.monotonic() + timeout_s
        failed: dict[bytes, str] = {}
        while True:
            for peer, key in keys.items():
                if peer in self._bad:
                    failed[peer] = self._bad[peer]
                elif key in self._stash and (got := self._stash[key][0].shape[0]) != rows[peer]:
                    self._stash.pop(key)
                    failed[peer] = f"sent {got} rows, its plan said {rows[peer]}"
            waiting = [p for p, key in keys.items() if key not in self._stash and p not in failed]
            left = deadline - time.monotonic()
            if not waiting:
                break
            if left <= 0:
                failed.update({p: f"no data for layer {transfer.layer} stage {transfer.stage} within {timeout_s:.0f} s"
                               for p in waiting})
                break
            if stop():
                raise Interrupted()
            watch.pump(min(left, WAIT_SLICE_S))
        delivered = transfer.only({p for p in transfer.peers if p not in failed})
        pieces = [self._stash.pop(keys[peer]) for peer in delivered.peers]
        if not pieces:
            return Received(delivered, torch.empty(0, self.contract.hidden_size), None, failed)
        hidden = torch.cat([hidden for hidden, _ in pieces]) if len(pieces) > 1 else pieces[0][0]
        logits = None
        if self.contract.logit_cols:
            logits = torch.cat([lg for _, lg in pieces]) if len(pieces) > 1 else pieces[0][1]
        return Received(delivered, hidden, logits, failed)

    def send(self, output: torch.Tensor, transfer: FFNTransfer) -> None:
        for peer, step, piece in zip(transfer.peers, transfer.steps, output.split(list(transfer.rows))):
            # the output's own dtype: the contract's, or float32 partial sums from an expert-parallel shard
            header = wire.DataHeader(step, transfer.layer, transfer.stage, piece.shape[0], piece.shape[1],
                                     DTYPE_NAMES[piece.dtype])
            if not self.transport.send("data", peer, [wire.encode(header), to_frame(piece)]):
                log.warning("peer %s vanished before its output of layer %d", show(peer), transfer.layer)

    def flush(self) -> None:
        pass  # every send left at once

    def finish_step(self, peers: tuple[bytes, ...], watch: PeerWatch) -> dict[bytes, str]:
        return {}  # host transfers are done; receive failures came back in `recv`

    def fail_step(self, peers: tuple[bytes, ...], error: str, watch: PeerWatch) -> dict[bytes, str]:
        return {peer: f"a transfer of the step failed: {error}" for peer in peers}

    def close(self) -> None:
        self._stash.clear()
