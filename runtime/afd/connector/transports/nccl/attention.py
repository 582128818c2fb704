"""The `nccl` data plane: control plane over zmq, tensors over NCCL pair communicators.

Each attention rank shares a two-rank communicator with its FFN rank; the FFN creates
the unique id and ships it in the HelloReply, so no extra rendezvous port or global
world is needed, and a pair is rebuilt by re-handshaking. No header travels with the
tensors: both sides walk the same crossing layers × stages and every row count comes
from the step plan (docs/architecture.md), so NCCL's in-order delivery pairs the messages. With the
gate on attention, hidden rows and router logits travel packed as one message, so every
transfer is exactly one message each way whichever side runs the gate.

Deadlock freedom with ping-pong: a send is not issued on its own but grouped with the
next receive of the same side (`ncclGroupStart/End`). Attention's "send layer L, stage
0" is followed by "receive layer L-1, stage 1"; the FFN's "send layer L-1, stage 1" by
"receive layer L, stage 0": the same two transfers, each in one group on both ends.

All transfers are issued on torch's current stream, so a captured step replays them.

A lost peer's pair is aborted at once and never waited on: NCCL raises its abort flag
before tearing down, so transfers stuck on the dead peer end and the stream drains within
milliseconds; every new connection builds a new pair. A graceful close destroys the pair,
and `ncclCommDestroy` waits for the other end's destroy and for every CUDA graph holding the
pair's transfers, so graphs are released first (`bench/cluster/nccl_teardown.py` measures this).
This module is the attention end; the FFN end is `afd.connector.transports.nccl.ffn`; the registry entry
`afd.connector.transports.nccl`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from afd.connector.base import AttnTransfer, ConnectorError, HandshakeError, PeerLost
from afd.connector.transports.nccl.lib import Group, NcclError, PairComm, UniqueId, wait_event
from afd.connector.plane import AttentionPlane, PlaneOptions
from afd.connector.tensors import pack_rows
from afd.connector.wire import HelloReply

log = logging.getLogger(__name__)
ATTENTION_RANK_IN_PAIR = 1  # the FFN end is rank 0 (afd.connector.transports.nccl.ffn)
PAIR_JOIN_TIMEOUT_S = 30.0  # a first NCCL init in a fresh process (CUDA context, bootstrap) takes seconds


@dataclass
class StepMark:
    """The end of one launched step on the GPU; `cut` once a lost pair was aborted before it finished."""

    event: torch.cuda.Event
    cut: bool = False


class NcclAttentionPlane(AttentionPlane):
    """Attention end: hidden rows (and router logits) out, FFN rows back, on the GPU."""

    def __init__(self, options: PlaneOptions):
        self.options = options
        self.comm: PairComm | None = None
        self._pending: list[torch.Tensor] = []
        self._shapes: dict[tuple[int, int], tuple[int, int, torch.dtype]] = {}
        self._open: list[StepMark] = []  # steps launched and maybe still running
        self.return_dtype: torch.dtype | None = None  # float32 from an expert-parallel shard, else what was sent

    def bind(self, transport, reply: HelloReply, pump, timeout_s: float) -> None:
        self.abort()  # the pair of an earlier connection, if any: its FFN end is gone
        if not reply.nccl_id:
            raise HandshakeError(f"ffn rank {reply.ffn_rank} offered no NCCL communicator (is it running with connector=nccl?)")
        self.comm = join_pair(UniqueId.from_hex(reply.nccl_id), ATTENTION_RANK_IN_PAIR, torch.device(self.options.device),
                              max(timeout_s, PAIR_JOIN_TIMEOUT_S), f"ffn rank {reply.ffn_rank}")

    def begin_step(self, step_id: int) -> None:
        pass  # nothing is keyed by step: NCCL delivers in order

    def accept(self, frames: list[bytes]) -> None:
        raise PeerLost("the ffn rank sent host data frames, but the data plane is nccl")

    def send(self, hidden: torch.Tensor, transfer: AttnTransfer, router_logits: torch.Tensor | None) -> None:
        """Queue [tokens, hidden] (packed with float32 [tokens, experts] logits); it leaves with the next receive."""
        self._pending.append(hidden.contiguous() if router_logits is None else pack_rows(hidden, router_logits))
        self._shapes[(transfer.layer, transfer.stage)] = (hidden.shape[0], hidden.shape[1], hidden.dtype)

    def issue_sends(self) -> None:
        """The queued sends on their own: safe because the FFN end always posts its receive grouped
        with its own pending send, so nothing waits on this side's next receive."""
        if not self._pending or self.comm is None:
            return
        try:
            with Group():
                for tensor in self._pending:
                    self.comm.send(tensor)
        except NcclError as err:
            self.abort()
            raise PeerLost(str(err)) from None
        self._pending.clear()

    def recv(self, transfer: AttnTransfer) -> torch.Tensor:
        rows, cols, dtype = self._shapes.pop((transfer.layer, transfer.stage))
        out = torch.empty(rows, cols, dtype=self.return_dtype or dtype, device=self.options.device)  # [tokens, hidden]
        if self.comm is None:
            raise PeerLost("no NCCL pair (the link was lost)")
        try:
            with Group():
                for tensor in self._pending:
                    self.comm.send(tensor)
                self.comm.recv(out)
        except NcclError as err:  # NCCL saw the FFN go (its network transport notices a closed socket)
            self.abort()
            raise PeerLost(str(err)) from None
        self._pending.clear()
        return out

    def end_step(self) -> "StepMark":
        """An event after the step's work on the current stream: the host goes on while the GPU runs it."""
        mark = StepMark(torch.cuda.Event())
        mark.event.record()
        self._open = [m for m in self._open if not m.event.query()] + [mark]  # at most the steps still running
        return mark

    def finish_step(self, mark: "StepMark | None", tick) -> None:
        """Wait for the step of `mark` on the GPU, heartbeating meanwhile; a lost FFN aborts the pair at once.

        The FFN is lost when its connection closes or it says Goodbye (`tick` raises), or
        when the step outlasts the peer timeout: every in-flight request then ends within it.
        A step the abort of a lost pair cut short raises too: its results are not to be read.
        """
        mark = mark or self.end_step()
        if mark.cut:
            raise PeerLost("the link was lost before the step's transfers finished")
        timeout_s = self.options.peer_timeout_s
        try:
            done = wait_event(mark.event, time.monotonic() + timeout_s, tick)
        except PeerLost:
            self.abort()
            raise
        if not done:
            self.abort()
            raise PeerLost(f"the step's NCCL transfers did not finish within {timeout_s:.0f} s")

    def abort(self) -> None:
        """Abort the pair (stuck transfers end at once) and wait, bounded, until the stream has drained."""
        self._pending.clear()
        self._shapes.clear()
        for mark in self._open:  # a step done before the abort is good; the others were cut short
            mark.cut = not mark.event.query()
        self._open.clear()
        if self.comm is None:
            return
        comm, self.comm = self.comm, None
        comm.abort(wait_s=0.0)  # NCCL raises its abort flag first; the rest of the teardown goes on behind
        with torch.cuda.device(torch.device(self.options.device)):
            event = torch.cuda.Event()
            event.record()
        if not wait_event(event, time.monotonic() + self.options.peer_timeout_s):
            raise ConnectorError(f"the GPU stream is still blocked {self.options.peer_timeout_s:.0f} s after aborting "
                                 "the NCCL pair; restart this rank")

    def close(self) -> None:
        """Destroy the pair: every step ended with `finish_step` (a stuck one aborted it), nothing is in flight."""
        if self.comm is not None:
            started = time.monotonic()
            if self.comm.close():
                log.info("NCCL pair destroyed in %.2f s", time.monotonic() - started)
            else:
                log.warning("NCCL pair teardown still running after %.1f s; carrying on", time.monotonic() - started)
        self.comm = None


def join_pair(uid: UniqueId, rank: int, device: torch.device, timeout_s: float, peer: str) -> PairComm:
    """Create this end of a pair, waiting at most `timeout_s` for the other end to join."""
    box: dict = {}

    def init() -> None:
        try:
            box["comm"] = PairComm(uid, rank, device)
        except NcclError as err:
            box["error"] = str(err)

    thread = threading.Thread(target=init, name="nccl-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "comm" not in box:
        raise HandshakeError(f"NCCL pair with {peer} not built: {box.get('error', f'its end did not join within {timeout_s:.0f} s')}")
    return box["comm"]
