"""The `nccl` connector: control plane over zmq, data plane over NCCL pair communicators.

Each attention rank shares a two-rank communicator with its FFN rank; the FFN creates
the unique id and ships it in the HelloReply, so no extra rendezvous port or global
world is needed, and a pair is rebuilt by re-handshaking. No header travels with the
tensors: both sides walk the same crossing layers × stages and every row count comes
from the step plan (DESIGN §3), so NCCL's in-order delivery pairs the messages. With the
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
from afd.connector.base import AttnTransfer, ConnectorError, FFNTransfer, HandshakeError, PeerLost
from afd.connector.ffn_side import DataContract, FFNConnector
from afd.connector.identity import show
from afd.connector.nccl_lib import Group, NcclError, PairComm, UniqueId, new_unique_id
from afd.connector.tensors import DTYPES, pack_rows, packed_width, unpack_rows
from afd.connector.wire import Hello, HelloReply

log = logging.getLogger(__name__)
FFN_RANK_IN_PAIR, ATTENTION_RANK_IN_PAIR = 0, 1
PAIR_JOIN_TIMEOUT_S = 30.0  # a first NCCL init in a fresh process (CUDA context, bootstrap) takes seconds


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
        self.abandon()  # the pair of an earlier link, if any: its FFN end is gone
        if not reply.nccl_id:
            raise HandshakeError(f"ffn rank {self.ffn_rank} offered no NCCL communicator (is it running with connector=nccl?)")
        self.comm = join_pair(UniqueId.from_hex(reply.nccl_id), ATTENTION_RANK_IN_PAIR, torch.device(self.device),
                              max(timeout_s, PAIR_JOIN_TIMEOUT_S), f"ffn rank {self.ffn_rank}")
        return reply

    def send_attn_output(self, hidden: torch.Tensor, transfer: AttnTransfer, router_logits: torch.Tensor | None = None) -> None:
        """Queue [tokens, hidden] (packed with float32 [tokens, experts] logits); it leaves with the next receive."""
        self._pending.append(hidden.contiguous() if router_logits is None else pack_rows(hidden, router_logits))
        self._shapes[(transfer.layer, transfer.stage)] = (hidden.shape[0], hidden.shape[1], hidden.dtype)

    def recv_ffn_output(self, transfer: AttnTransfer) -> torch.Tensor:
        rows, cols, dtype = self._shapes.pop((transfer.layer, transfer.stage))
        out = torch.empty(rows, cols, dtype=dtype, device=self.device)  # [tokens, hidden]
        if self.comm is None:
            raise PeerLost(f"ffn rank {self.ffn_rank}: no NCCL pair (the link was lost)")
        try:
            with Group():
                for tensor in self._pending:
                    self.comm.send(tensor)
                self.comm.recv(out)
        except NcclError as err:  # NCCL saw the FFN go (its network transport notices a closed socket)
            self.abandon()
            raise PeerLost(f"ffn rank {self.ffn_rank}: {err}") from None
        self._pending.clear()
        return out

    def wait_step(self) -> None:
        """Wait for the step on the GPU, heartbeating meanwhile; a lost FFN aborts the pair at once.

        The FFN is lost when its connection closes or it says Goodbye (`tick` raises), or
        when the step outlasts the peer timeout: every in-flight request then ends within it.
        """
        event = torch.cuda.Event()
        event.record()
        try:
            done = wait_event(event, time.monotonic() + self.peer_timeout_s, self.tick)
        except PeerLost:
            self.abandon()
            raise
        if not done:
            self.abandon()
            raise PeerLost(f"ffn rank {self.ffn_rank}: the step's NCCL transfers did not finish within {self.peer_timeout_s:.0f} s")

    def abandon(self) -> None:
        """Abort the pair (stuck transfers end at once) and wait, bounded, until the stream has drained."""
        self._pending.clear()
        self._shapes.clear()
        if self.comm is None:
            return
        comm, self.comm = self.comm, None
        comm.abort(wait_s=0.0)  # NCCL raises its abort flag first; the rest of the teardown goes on behind
        with torch.cuda.device(torch.device(self.device)):
            event = torch.cuda.Event()
            event.record()
        if not wait_event(event, time.monotonic() + self.peer_timeout_s):
            raise ConnectorError(f"the GPU stream is still blocked {self.peer_timeout_s:.0f} s after aborting "
                                 f"the NCCL pair with ffn rank {self.ffn_rank}; restart this rank")

    def close(self, reason: str = "shutdown") -> None:
        try:
            super().close(reason)
        finally:
            # every step ended with wait_step (a stuck one aborted the pair there): nothing is in flight
            if self.comm is not None:
                started = time.monotonic()
                if self.comm.close():
                    log.info("NCCL pair with ffn rank %d destroyed in %.2f s", self.ffn_rank, time.monotonic() - started)
                else:
                    log.warning("NCCL teardown of the pair with ffn rank %d still running after %.1f s; carrying on",
                                self.ffn_rank, time.monotonic() - started)
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


class NcclFFNConnector(FFNConnector):
    """FFN end: one pair communicator per attention peer, created when its Hello is accepted."""

    PROBE_AFTER_S = 0.2  # a step waiting longer than this probes its peers (who is gone?) every as often

    def __init__(self, transport, device, peer_timeout_s: float, contract: DataContract):
        super().__init__(transport, device, peer_timeout_s, contract)
        self.comms: dict[bytes, PairComm] = {}
        self._inits: dict[bytes, tuple[str, threading.Thread, dict]] = {}
        self._pending: list[tuple[bytes, torch.Tensor]] = []
        self.dtype = DTYPES[contract.dtype]
        self.failed_peers: dict[bytes, str] = {}

    def accept_peer(self, peer: bytes) -> dict:
        super().accept_peer(peer)
        pending = self._inits.get(peer)
        if pending is not None and pending[1].is_alive():
            return {"nccl_id": pending[0]}  # a repeated Hello of the same handshake
        self._forget(peer)
        uid = new_unique_id()
        box: dict = {}
        thread = threading.Thread(target=self._init_comm, args=(uid, box), name=f"nccl-init-{show(peer)}", daemon=True)
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
            raise PeerLost(f"no NCCL communicator with {show(peer)}: {box.get('error', 'init timed out')}")
        self.comms[peer] = box["comm"]
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

    def wait_step(self, peers: tuple[bytes, ...]) -> dict[bytes, str]:
        """Wait for the step on the GPU; returns the peers lost meanwhile, with why.

        A peer whose connection closes, or that stops heartbeating, while the step waits
        has its pair aborted at once: the transfers with it end, the others complete, so
        the ranks still alive lose nothing. Past the peer timeout every pair is aborted.
        """
        event = torch.cuda.Event()
        event.record()
        started = time.monotonic()
        failed: dict[bytes, str] = {}
        next_probe = [started + self.PROBE_AFTER_S]

        def probe() -> None:
            now = time.monotonic()
            if now < next_probe[0]:
                return
            next_probe[0] = now + self.PROBE_AFTER_S
            while self._pump(0.0):
                pass  # heartbeats of the peers still alive; control messages wait for the loop
            for peer in peers:
                if peer not in failed and (reason := self.peer_problem(peer, 0.6 * self.peer_timeout_s)):
                    log.info("aborting the NCCL pair with %s mid-step: %s", show(peer), reason)
                    failed[peer] = reason
                    self._forget(peer)

        if not wait_event(event, started + self.peer_timeout_s, probe):
            stuck = [p for p in peers if p not in failed]
            log.error("NCCL step with %s did not finish within %.0f s; aborting their communicators",
                      [show(p) for p in stuck], self.peer_timeout_s)
            for peer in stuck:
                failed[peer] = f"the step's transfers did not finish within {self.peer_timeout_s:.0f} s"
                self._forget(peer)
            if not wait_event(event, time.monotonic() + self.peer_timeout_s):
                log.error("the GPU stream is still blocked after aborting every pair of the step")
        return failed

    def fail_step(self, peers: tuple[bytes, ...], error: str) -> dict[bytes, str]:
        """A transfer of the step failed outright: abort the pairs of the peers that are gone (probed
        for up to half a second), or of every peer of the step when none can be told apart."""
        self._pending.clear()
        lost: dict[bytes, str] = {}
        deadline = time.monotonic() + 0.5
        while not lost and time.monotonic() < deadline:
            lost = {peer: f"{why} ({error})" for peer in peers if (why := self.peer_problem(peer))}
            if not lost:
                time.sleep(0.05)
        lost = lost or {peer: f"a transfer of the step failed: {error}" for peer in peers}
        for peer in lost:
            log.info("aborting the NCCL pair with %s: %s", show(peer), lost[peer])
            self._forget(peer)
        event = torch.cuda.Event()
        event.record()
        if not wait_event(event, time.monotonic() + self.peer_timeout_s):
            log.error("the GPU stream is still blocked after aborting the failed step's pairs")
        return lost

    def forget_peer(self, peer: bytes, graceful: bool = False) -> None:
        super().forget_peer(peer, graceful)
        self._forget(peer, graceful)

    def _forget(self, peer: bytes, graceful: bool = False) -> None:
        comm = self.comms.pop(peer, None)
        if comm is not None:
            if graceful:  # Goodbye between steps: nothing in flight, destroy (bounded, other peers wait on this loop)
                if not comm.close(wait_s=1.0):
                    log.info("NCCL teardown of the pair with %s still running; carrying on", show(peer))
            else:  # lost: raise the abort flag so stuck transfers end, and carry on at once
                comm.abort(wait_s=0.0)
        self._inits.pop(peer, None)

    def close(self) -> None:
        for peer in list(self.comms):
            self._forget(peer)
        super().close()


def make_ffn_connector(config: AFDConfig, device, contract: DataContract) -> NcclFFNConnector:
    from afd.connector.zmq_transport import ZmqServer

    transport = ZmqServer(config.bind_host, config.ffn_ports(config.rank), config.max_message_bytes)
    return NcclFFNConnector(transport, device, config.peer_timeout_s, contract)
