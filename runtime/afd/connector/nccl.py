"""The `nccl` connector: control plane over zmq, data plane over NCCL pair communicators.

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
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from afd.config import AFDConfig
from afd.connector.attention_side import AttentionConnector
from afd.connector.base import AttnTransfer, FFNTransfer, HandshakeError, PeerLost
from afd.connector.ffn_side import DataContract, FFNConnector
from afd.connector.nccl_lib import Group, NcclError, PairComm, UniqueId, new_unique_id
from afd.connector.tensors import DTYPES, pack_rows, packed_width, unpack_rows
from afd.connector.wire import Hello, HelloReply

log = logging.getLogger(__name__)
FFN_RANK_IN_PAIR, ATTENTION_RANK_IN_PAIR = 0, 1


def wait_event(event: torch.cuda.Event, deadline: float, check=None) -> bool:
    """Poll `event` until done (True) or `deadline` passes (False); `check()` may raise."""
    polls = 0
    while not event.query():
        polls += 1
        if polls % 256 == 0:
            if time.monotonic() > deadline:
                return False
            if check is not None:
                check()
        time.sleep(0)
    return True


class NcclAttentionConnector(AttentionConnector):
    """Attention end: hidden rows (and router logits) out, FFN rows back, on the GPU."""

    def __init__(self, transport, ffn_rank: int, device, peer_timeout_s: float):
        super().__init__(transport, ffn_rank, device, peer_timeout_s)
        self.comm: PairComm | None = None
        self._pending: list[torch.Tensor] = []
        self._shapes: dict[tuple[int, int], tuple[int, int, torch.dtype]] = {}

    def handshake(self, hello: Hello, timeout_s: float) -> HelloReply:
        reply = super().handshake(hello, timeout_s)
        if self.comm is not None:  # a re-handshake after the FFN came back: its old end is gone
            self.comm.abort(wait_s=1.0)
        if not reply.nccl_id:
            raise HandshakeError(f"ffn rank {self.ffn_rank} offered no NCCL communicator (is it running with connector=nccl?)")
        self.comm = PairComm(UniqueId.from_hex(reply.nccl_id), ATTENTION_RANK_IN_PAIR, torch.device(self.device))
        return reply

    def send_attn_output(self, hidden: torch.Tensor, transfer: AttnTransfer, router_logits: torch.Tensor | None = None) -> None:
        """Queue [tokens, hidden] (packed with float32 [tokens, experts] logits); it leaves with the next receive."""
        self._pending.append(hidden.contiguous() if router_logits is None else pack_rows(hidden, router_logits))
        self._shapes[(transfer.layer, transfer.stage)] = (hidden.shape[0], hidden.shape[1], hidden.dtype)

    def recv_ffn_output(self, transfer: AttnTransfer) -> torch.Tensor:
        rows, cols, dtype = self._shapes.pop((transfer.layer, transfer.stage))
        out = torch.empty(rows, cols, dtype=dtype, device=self.device)  # [tokens, hidden]
        with Group():
            for tensor in self._pending:
                self.comm.send(tensor)
            self.comm.recv(out)
        self._pending.clear()
        return out

    def wait_step(self) -> None:
        """Wait for the step on the GPU, at most the peer timeout; a stuck step aborts the pair."""
        event = torch.cuda.Event()
        event.record()
        if not wait_event(event, time.monotonic() + self.peer_timeout_s, self._check_goodbye):
            self.comm.abort()
            raise PeerLost(f"ffn rank {self.ffn_rank}: the step's NCCL transfers did not finish within {self.peer_timeout_s:.0f} s")

    def _check_goodbye(self) -> None:
        received = self.transport.recv(0.0)
        if received is not None and received[0] == "control":
            self._on_message(*received)  # raises PeerLost on Goodbye

    def close(self, reason: str = "shutdown") -> None:
        try:
            super().close(reason)
        finally:
            # every step ended with wait_step (a stuck one aborted the pair there): nothing is in flight
            if self.comm is not None and not self.comm.close():
                log.warning("NCCL teardown of the pair with ffn rank %d still running; carrying on", self.ffn_rank)
            self.comm = None


class NcclFFNConnector(FFNConnector):
    """FFN end: one pair communicator per attention peer, created when its Hello is accepted."""

    def __init__(self, transport, device, peer_timeout_s: float, contract: DataContract):
        super().__init__(transport, device, peer_timeout_s, contract)
        self.comms: dict[bytes, PairComm] = {}
        self._inits: dict[bytes, tuple[str, threading.Thread, dict]] = {}
        self._pending: list[tuple[bytes, torch.Tensor]] = []
        self.dtype = DTYPES[contract.dtype]
        self.generation = 0  # bumped whenever a communicator changes: captured graphs are stale then
        self.failed_peers: dict[bytes, str] = {}

    def accept_peer(self, peer: bytes) -> dict:
        super().accept_peer(peer)
        pending = self._inits.get(peer)
        if pending is not None and pending[1].is_alive():
            return {"nccl_id": pending[0]}  # a repeated Hello of the same handshake
        self._forget(peer)
        uid = new_unique_id()
        box: dict = {}
        thread = threading.Thread(target=self._init_comm, args=(uid, box), name=f"nccl-init-{peer.decode(errors='replace')}", daemon=True)
        thread.start()
        self._inits[peer] = (uid.to_hex(), thread, box)
        return {"nccl_id": uid.to_hex()}

    def _init_comm(self, uid: UniqueId, box: dict) -> None:
        try:
            box["comm"] = PairComm(uid, FFN_RANK_IN_PAIR, torch.device(self.device))
        except NcclError as err:
            box["error"] = str(err)

    def _comm(self, peer: bytes) -> PairComm:
        if peer in self.comms:
            return self.comms[peer]
        uid, thread, box = self._inits[peer]
        thread.join(self.peer_timeout_s)
        if "comm" not in box:
            raise PeerLost(f"no NCCL communicator with {peer.decode(errors='replace')}: {box.get('error', 'init timed out')}")
        self.comms[peer] = box["comm"]
        self.generation += 1
        return box["comm"]

    def recv_attn_output(self, transfer: FFNTransfer):
        """Every peer's rows received straight into one [sum(rows), hidden] buffer, in peer order."""
        self.failed_peers = {}
        comms = [self._comm(peer) for peer in transfer.peers]
        total, cols = sum(transfer.rows), self.contract.logit_cols
        if cols:  # hidden and logits travel packed in one message per peer (`pack_rows`)
            width = packed_width(self.contract.hidden_size, self.dtype, cols)
            buffer = torch.empty(total, width, dtype=torch.uint8, device=self.device)
        else:
            buffer = torch.empty(total, self.contract.hidden_size, dtype=self.dtype, device=self.device)
        with Group():
            self._issue_pending()
            start = 0
            for comm, rows in zip(comms, transfer.rows):
                comm.recv(buffer[start : start + rows])
                start += rows
        if cols:
            hidden, logits = unpack_rows(buffer, self.contract.hidden_size, self.dtype, cols)
            return transfer, hidden, logits
        return transfer, buffer, None

    def send_ffn_output(self, output: torch.Tensor, transfer: FFNTransfer) -> None:
        """Queue each peer's rows; they leave with the next receive or at the end of the step."""
        for peer, piece in zip(transfer.peers, output.split(list(transfer.rows))):
            self._pending.append((peer, piece))

    def end_step(self) -> None:
        if self._pending:
            with Group():
                self._issue_pending()

    def _issue_pending(self) -> None:
        for peer, piece in self._pending:
            self.comms[peer].send(piece)
        self._pending.clear()

    def wait_step(self, peers: tuple[bytes, ...]) -> tuple[bytes, ...]:
        """Wait for the step on the GPU; on timeout abort every pair in it and return those peers."""
        event = torch.cuda.Event()
        event.record()
        if wait_event(event, time.monotonic() + self.peer_timeout_s):
            return ()
        log.error("NCCL step with %s did not finish within %.0f s; aborting their communicators",
                  [p.decode(errors="replace") for p in peers], self.peer_timeout_s)
        for peer in peers:
            self._forget(peer)
        return peers

    def forget_peer(self, peer: bytes, graceful: bool = False) -> None:
        super().forget_peer(peer, graceful)
        self._forget(peer, graceful)

    def _forget(self, peer: bytes, graceful: bool = False) -> None:
        comm = self.comms.pop(peer, None)
        if comm is not None:
            teardown = comm.close if graceful else comm.abort  # Goodbye between steps: nothing in flight
            if not teardown(wait_s=1.0):  # other peers wait on this loop: do not hold it long
                log.warning("NCCL teardown of the pair with %s still running; carrying on", peer.decode(errors="replace"))
            self.generation += 1
        self._inits.pop(peer, None)

    def close(self) -> None:
        for peer in list(self.comms):
            self._forget(peer)
        super().close()


def make_attention_connector(config: AFDConfig, ffn_rank: int, identity: bytes, device) -> NcclAttentionConnector:
    from afd.connector.zmq_transport import ZmqPeer

    transport = ZmqPeer(config.ffn_host(ffn_rank), config.ffn_ports(ffn_rank), identity)
    return NcclAttentionConnector(transport, ffn_rank, device, config.peer_timeout_s)


def make_ffn_connector(config: AFDConfig, device, contract: DataContract) -> NcclFFNConnector:
    from afd.connector.zmq_transport import ZmqServer

    transport = ZmqServer(config.bind_host, config.ffn_ports(config.rank), config.max_message_bytes)
    return NcclFFNConnector(transport, device, config.peer_timeout_s, contract)
