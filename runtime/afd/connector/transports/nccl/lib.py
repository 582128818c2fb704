"""A minimal ctypes binding of NCCL's point-to-point API, issued on torch's current stream.

Why not torch.distributed: it needs one world of every rank fixed at start-up (a dead
peer takes the world down, while recovery needs pairs that can be rebuilt alone), and its
process groups run on internal streams. A two-rank communicator per attention↔FFN pair,
created from an id that travels in the zmq handshake, issues `ncclSend`/`ncclRecv` on the
caller's stream, so the transfers sit inside CUDA graphs like any kernel.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
import time

import torch

from afd.config import process_setting
from afd.connector.base import ConnectorError

NCCL_UINT8 = 1
ABORT_WAIT_S = 5.0


class NcclError(ConnectorError):
    """An NCCL call failed (e.g. "remote process exited" on the socket transport): the pair is unusable."""


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]

    def to_hex(self) -> str:
        return bytes(self.internal).hex()

    @classmethod
    def from_hex(cls, text: str) -> "UniqueId":
        raw = bytes.fromhex(text)
        if len(raw) != 128:
            raise NcclError(f"an NCCL unique id has 128 bytes, got {len(raw)}")
        uid = cls()
        ctypes.memmove(uid.internal, raw, 128)
        return uid


def _candidates() -> list[str]:
    # torch's CUDA build has already loaded libnccl.so.2, so the soname resolves to it
    names = [process_setting("AFD_NCCL_LIBRARY"), "libnccl.so.2", "libnccl.so"]
    try:
        import nvidia.nccl  # type: ignore  # local import: optional pip wheel of NCCL: most hosts have none

        names += glob.glob(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so*"))
    except ImportError:
        pass
    return [n for n in names if n]


class _Library:
    def __init__(self) -> None:
        # Captured transfers go through NCCL's own FIFO buffers: registering graph-pool buffers
        # for zero-copy ties a graph to addresses the peer saw at its own capture.
        os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")
        errors = []
        for name in _candidates():
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError as err:
                errors.append(f"{name}: {err}")
        else:
            raise NcclError("libnccl not found (set AFD_NCCL_LIBRARY): " + "; ".join(errors[-3:]))
        lib, p, i, sz = self.lib, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [i]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(p), i, UniqueId, i]
        lib.ncclSend.argtypes = [p, sz, i, i, p, p]
        lib.ncclRecv.argtypes = [p, sz, i, i, p, p]
        lib.ncclCommAbort.argtypes = [p]
        lib.ncclCommDestroy.argtypes = [p]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(i)]

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise NcclError(f"{what} failed: {self.lib.ncclGetErrorString(result).decode()} (nccl error {result})")


_LIB: _Library | None = None


def library() -> _Library:
    global _LIB
    if _LIB is None:
        _LIB = _Library()
    return _LIB


def version() -> int:
    value = ctypes.c_int()
    library().check(library().lib.ncclGetVersion(ctypes.byref(value)), "ncclGetVersion")
    return value.value


def new_unique_id() -> UniqueId:
    uid = UniqueId()
    library().check(library().lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return uid


class Group:
    """`with Group():` batches the sends and receives inside into one NCCL launch."""

    def __enter__(self) -> "Group":
        library().check(library().lib.ncclGroupStart(), "ncclGroupStart")
        return self

    def __exit__(self, *exc) -> None:
        library().check(library().lib.ncclGroupEnd(), "ncclGroupEnd")


class PairComm:
    """A two-rank communicator (rank 0: FFN, rank 1: attention) on one CUDA device."""

    def __init__(self, uid: UniqueId, rank: int, device: torch.device):
        self.rank, self.peer, self.device = rank, 1 - rank, device
        self._comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            library().check(library().lib.ncclCommInitRank(ctypes.byref(self._comm), 2, uid, rank), "ncclCommInitRank")
            self._connect()

    def _connect(self) -> None:
        """One symmetric grouped exchange, so both directions are connected before real traffic.

        NCCL connects peers lazily at their first group; if the two sides' first groups
        differ (attention: send + receive, FFN: receive only) its bootstrap exchange
        fails with "Message truncated". Connecting here makes later groups free to differ.

        The exchange runs on a stream of its own and is waited for by an event on that stream,
        never by a device-wide synchronize: the FFN builds pairs on helper threads while its
        main thread may be capturing a CUDA graph, and a device-wide sync during a capture
        fails (`cudaErrorStreamCaptureUnsupported`) and invalidates the capture. Captures
        run in `thread_local` mode (`afd.graphs.capture`), so this thread's calls on its own
        stream leave them alone. Not a lock between capture and setup: setup waits on the
        peer, and a capture must not wait on a peer.
        """
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
            back = torch.empty_like(probe)
            with Group():
                self.send(probe)
                self.recv(back)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()

    def send(self, tensor: torch.Tensor) -> None:
        """Queue `tensor` (contiguous, on this device) to the peer on the current stream."""
        self._p2p(library().lib.ncclSend, tensor, "ncclSend")

    def recv(self, tensor: torch.Tensor) -> None:
        """Queue a receive into `tensor` (contiguous, on this device) on the current stream."""
        self._p2p(library().lib.ncclRecv, tensor, "ncclRecv")

    def _p2p(self, fn, tensor: torch.Tensor, what: str) -> None:
        if self._comm is None:
            raise NcclError(f"{what} on a closed communicator")
        if not tensor.is_contiguous():
            raise NcclError(f"{what}: the tensor must be contiguous")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        count = tensor.numel() * tensor.element_size()
        library().check(fn(ctypes.c_void_p(tensor.data_ptr()), count, NCCL_UINT8, self.peer, self._comm, ctypes.c_void_p(stream)), what)

    def abort(self, wait_s: float = ABORT_WAIT_S) -> bool:
        """Tear down, unblocking any transfer still waiting on the peer; True when done in `wait_s`.

        `ncclCommAbort` was seen to block for over 90 s while the peer still held its end,
        so it runs on a daemon thread and the caller waits at most `wait_s`: a shutdown or
        a re-handshake is never held up by a peer that does not answer.
        """
        return self._release(library().lib.ncclCommAbort, wait_s)

    def close(self, wait_s: float = ABORT_WAIT_S) -> bool:
        """Graceful teardown (`ncclCommDestroy`) for a link with no transfer in flight; bounded like `abort`.

        `ncclCommDestroy` waits until every CUDA graph that captured this pair's transfers
        is destroyed (measured: 0.46 s with the graphs freed first, > 20 s with one alive;
        `bench/cluster/nccl_teardown.py`): release the graphs before closing the pair.
        """
        return self._release(library().lib.ncclCommDestroy, wait_s)

    def detach(self):
        """Hand over the raw `ncclComm_t` (None if already closed): this pair is closed from here on, and tearing the
        communicator down is the caller's."""
        comm, self._comm = self._comm, None
        return comm

    def _release(self, teardown, wait_s: float) -> bool:
        comm = self.detach()
        if comm is None:
            return True
        worker = threading.Thread(target=teardown, args=(comm,), name="nccl-teardown", daemon=True)
        worker.start()
        worker.join(wait_s)
        return not worker.is_alive()


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
