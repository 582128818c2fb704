"""The FFN end of the `nccl` connector: one NCCL pair per attention connection (see `.attention`)."""

from __future__ import annotations

import logging
import threading
import time

import torch

from afd.connector.base import FFNTransfer, PeerLost
from afd.connector.identity import show
from afd.connector.plane import DataContract, FFNPlane, PeerWatch, PlaneOptions, Received
from afd.connector.transports.nccl.lib import Group, NcclError, PairComm, UniqueId, new_unique_id, wait_event
from afd.connector.tensors import DTYPES, packed_width, unpack_rows

log = logging.getLogger(__name__)
FFN_RANK_IN_PAIR = 0


class NcclFFNPlane(FFNPlane):
    """FFN end: one pair communicator per attention peer, created when its Hello is accepted."""

    PROBE_AFTER_S = 0.2  # a step waiting longer than this probes its peers (who is gone?) every as often

    def __init__(self, options: PlaneOptions, contract: DataContract, transport=None):
        self.options, self.contract = options, contract
        self.device, self.peer_timeout_s = options.device, options.peer_timeout_s
        self.comms: dict[bytes, PairComm] = {}
        self._inits: dict[bytes, tuple[str, threading.Thread, dict]] = {}
        self._pending: list[tuple[bytes, torch.Tensor]] = []
        self.dtype = DTYPES[contract.dtype]

    def admit(self, peer: bytes) -> dict:
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

    def accept(self, peer: bytes, frames: list[bytes]) -> str | None:
        return "host data frames, but the data plane is nccl"

    def recv(self, transfer: FFNTransfer, watch: PeerWatch, stop) -> Received:
        """Every peer's rows received straight into one [sum(rows), hidden] buffer, in peer order.

        Outside a graph capture the rows are waited for (watching the peers) before anything
        computes on them: an eager step's compute may block the host (a kernel's first load
        waits for the running transfers), and a peer that failed mid-step would then hold
        this rank forever. A peer lost while waiting has its pair aborted and its rows left out.
        """
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
        failed: dict[bytes, str] = {}
        if not torch.cuda.is_current_stream_capturing():
            failed = self._wait(transfer.peers, watch)
            if failed:
                keep = torch.cat([torch.full((rows,), peer not in failed, dtype=torch.bool)
                                  for peer, rows in zip(transfer.peers, transfer.rows)]).to(buffer.device)
                buffer, transfer = buffer[keep], transfer.only(set(transfer.peers) - set(failed))
        if cols:
            hidden, logits = unpack_rows(buffer, self.contract.hidden_size, self.dtype, cols)
            return Received(transfer, hidden, logits, failed)
        return Received(transfer, buffer, None, failed)

    def send(self, output: torch.Tensor, transfer: FFNTransfer) -> None:
        """Queue each peer's rows; they leave with the next receive or at the end of the step."""
        for peer, piece in zip(transfer.peers, output.split(list(transfer.rows))):
            self._pending.append((peer, piece))

    def flush(self) -> None:
        if self._pending:
            with Group():
                self._issue_pending()

    def _issue_pending(self) -> None:
        for peer, piece in self._pending:
            if peer in self.comms:  # a peer lost earlier in the step gets nothing more
                self.comms[peer].send(piece)
        self._pending.clear()

    def finish_step(self, peers: tuple[bytes, ...], watch: PeerWatch) -> dict[bytes, str]:
        """Wait for the step on the GPU; returns the peers lost meanwhile, with why.

        A peer whose connection closes, or that stops heartbeating, while the step waits
        has its pair aborted at once: the transfers with it end, the others complete, so
        the ranks still alive lose nothing. Past the peer timeout every pair is aborted.
        """
        return self._wait(peers, watch)

    def _wait(self, peers: tuple[bytes, ...], watch: PeerWatch) -> dict[bytes, str]:
        """Wait for the work queued so far; the peers lost meanwhile (pairs aborted), with why."""
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
            while watch.pump(0.0):
                pass  # heartbeats of the peers still alive; control messages wait for the loop
            for peer in peers:
                if peer not in failed and (reason := watch.peer_problem(peer, 0.6 * self.peer_timeout_s)):
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

    def fail_step(self, peers: tuple[bytes, ...], error: str, watch: PeerWatch) -> dict[bytes, str]:
        """A transfer of the step failed outright: abort the pairs of the peers that are gone (probed
        for up to half a second), or of every peer of the step when none can be told apart."""
        self._pending.clear()
        lost: dict[bytes, str] = {}
        deadline = time.monotonic() + 0.5
        while not lost and time.monotonic() < deadline:
            lost = {peer: f"{why} ({error})" for peer in peers if (why := watch.peer_problem(peer))}
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

    def forget(self, peer: bytes, graceful: bool) -> None:
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

