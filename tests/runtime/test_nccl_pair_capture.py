"""Issue 35.1: an attention peer joining while the FFN warms up never breaks a graph capture.

No GPU here: a stand-in CUDA runtime keeps the one rule that matters (a device-wide
synchronize while any stream is capturing fails and invalidates the capture, as
`cudaErrorStreamCaptureUnsupported` does), a stand-in NCCL lets the test decide when the
peer joins, and the FFN's real graph cache and pair-setup thread run against them. The
peer joins during each phase of the warm-up the attention side drives (eager warm-up,
capture, replay); tests/gpu/test_gpu_pair_capture.py does the same on a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from types import SimpleNamespace

import pytest
import torch

from afd.connector.transports.nccl import lib as nccl_lib
from afd.connector.transports.nccl.ffn import NcclFFNPlane
from afd.connector.plane import DataContract, PlaneOptions
from afd.graphs.ffn_graphs import FFNGraphs

OLD, NEW = b"attention-0", b"attention-1"


class CaptureBroken(RuntimeError):
    pass


class FakeCuda:
    """Streams, events and captures by handle; records every call that would break a capture."""

    def __init__(self):
        self.handles = itertools.count(1)
        self.capturing: set[int] = set()
        self.invalidated = False
        self.violations: list[str] = []
        self.local = threading.local()
        self.default = self.Stream()

    def _violate(self, what: str) -> None:
        self.violations.append(f"{what} in thread {threading.current_thread().name}")
        self.invalidated = True
        raise CaptureBroken(f"{what}: operation not permitted when stream is capturing")

    def Stream(self, device=None):  # noqa: N802 (torch's name)
        return SimpleNamespace(cuda_stream=next(self.handles))

    def current_stream(self, device=None):
        return getattr(self.local, "stream", self.default)

    @contextlib.contextmanager
    def stream(self, stream):
        previous = self.current_stream()
        self.local.stream = stream
        try:
            yield
        finally:
            self.local.stream = previous

    def device(self, device):
        return contextlib.nullcontext()

    def synchronize(self, device=None):
        if self.capturing:
            self._violate("device-wide synchronize")

    def Event(self, *args, **kwargs):  # noqa: N802
        cuda = self

        class Event:
            stream = None

            def record(self, stream=None):
                self.stream = (stream or cuda.current_stream()).cuda_stream

            def query(self):
                return True

            def synchronize(self):
                if self.stream in cuda.capturing:
                    cuda._violate("event synchronize on a capturing stream")

        return Event()

    def is_current_stream_capturing(self):
        return self.current_stream().cuda_stream in self.capturing


class FakePool:
    """`GraphPool` on the stand-in: the capture is open while the step's body records."""

    memory_bytes = 0

    def __init__(self, cuda: FakeCuda):
        self.cuda = cuda

    def capture(self, fn):
        self.cuda.synchronize()  # torch.cuda.graph syncs the device before capturing
        stream = self.cuda.Stream()
        self.cuda.capturing.add(stream.cuda_stream)
        self.cuda.invalidated = False
        try:
            with self.cuda.stream(stream):
                fn()
        finally:
            self.cuda.capturing.discard(stream.cuda_stream)
        if self.cuda.invalidated:
            raise CaptureBroken("the capture was invalidated")
        return SimpleNamespace(replay=fn)


class FakeNccl:
    """NCCL calls that succeed; a communicator's init waits until the test lets its peer join."""

    def __init__(self, cuda: FakeCuda):
        self.cuda, self.joined, self.issued = cuda, threading.Event(), []
        self.joined.set()  # the peer already there joins at once

    def ncclGetUniqueId(self, uid):
        return 0

    def ncclCommInitRank(self, comm, nranks, uid, rank):
        return 0 if self.joined.wait(10) else 1

    def ncclSend(self, buf, count, dtype, peer, comm, stream):
        self.issued.append((threading.current_thread().name, stream.value))
        return 0

    ncclRecv = ncclSend

    def ncclGroupStart(self):
        return 0

    ncclGroupEnd = ncclGroupStart

    def ncclCommAbort(self, comm):
        return 0

    ncclCommDestroy = ncclCommAbort

    def ncclGetErrorString(self, result):
        return b"the peer never joined"


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("Stream", "current_stream", "stream", "device", "synchronize", "Event", "is_current_stream_capturing"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    library = object.__new__(nccl_lib._Library)  # its methods, the stand-in's calls
    library.lib = FakeNccl(fake)
    monkeypatch.setattr(nccl_lib, "_LIB", library)
    return fake


def plans(phase: str, peers) -> dict:
    flags = {"warmup": (True, False, False), "capture": (False, True, False), "replay": (False, False, True)}[phase]
    return {peer: SimpleNamespace(stage_tokens=(4,), warmup=flags[0], capture=flags[1], replay=flags[2]) for peer in peers}


@pytest.mark.parametrize("phase", ["warmup", "capture", "replay"])
def test_a_peer_joining_in_any_warmup_phase_leaves_the_capture_and_its_pair_whole(cuda, phase):
    plane = NcclFFNPlane(PlaneOptions("cpu", peer_timeout_s=5.0), DataContract(hidden_size=8, dtype="bfloat16", logit_cols=0))
    graphs = FFNGraphs(torch.device("cpu"))
    graphs.pool = FakePool(cuda)
    library = nccl_lib._LIB.lib
    plane.admit(OLD)
    plane._comm(OLD)  # the first attention rank is linked; the FFN warms up with it
    library.joined.clear()
    plane.admit(NEW)  # the second one's Hello arrives: its pair is set up on a helper thread
    modes, now = [], {}

    def body() -> None:  # what a step records or runs; a replay runs it again
        if now["phase"] == phase and not library.joined.is_set():
            library.joined.set()  # the new peer joins now, in the middle of this step
            plane._inits[NEW][1].join(5)  # and its pair setup runs to the end while the step is open

    for step_phase in ("warmup", "capture", "replay"):
        now["phase"] = step_phase
        modes.append(graphs.run(plans(step_phase, [OLD]), body))

    assert modes == ["eager", "capture", "replay"]
    assert cuda.violations == []
    assert plane._comm(NEW) is not None  # the pair is usable
    setup = [stream for thread, stream in library.issued if thread.startswith("nccl-init")]
    assert setup and not set(setup) & {cuda.default.cuda_stream}, "the probe ran on a stream of its own"
