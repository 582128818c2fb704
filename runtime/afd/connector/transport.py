"""Frame transports under the connector: a peer side (attention) and a server side (FFN).

Two planes share one link: `control` (small msgpack messages) and `data` (a header
frame plus tensor frames). A transport only moves lists of byte frames; the
connectors above it give them meaning. `loopback` keeps both ends in one process.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from typing import Sequence

PLANES = ("control", "data")
Frames = Sequence[bytes | memoryview]


class PeerTransport(ABC):
    """The attention end of one link to one FFN rank."""

    @abstractmethod
    def send(self, plane: str, frames: Frames) -> None: ...

    @abstractmethod
    def recv(self, timeout_s: float) -> tuple[str, list[bytes]] | None:
        """The next (plane, frames) from the FFN, or None after `timeout_s`.

        The plane is `control`, `data`, or `down` (the FFN's end of the connection closed;
        the one frame says how) for transports that can see that.
        """

    @abstractmethod
    def close(self) -> None: ...


class ServerTransport(ABC):
    """The FFN end: many attention peers, each known by an identity."""

    @abstractmethod
    def send(self, plane: str, peer: bytes, frames: Frames) -> bool:
        """Queue frames for `peer`; False when the peer is not connected."""

    @abstractmethod
    def recv(self, timeout_s: float) -> tuple[str, bytes, list[bytes]] | None:
        """The next (plane, peer, frames) from any peer, or None after `timeout_s`."""

    @abstractmethod
    def close(self) -> None: ...


class _Hub:
    """In-process rendezvous of one loopback FFN address."""

    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.outboxes: dict[bytes, queue.Queue] = {}
        self.lock = threading.Lock()

    def outbox(self, peer: bytes) -> queue.Queue:
        with self.lock:
            return self.outboxes.setdefault(peer, queue.Queue())


_HUBS: dict[str, _Hub] = {}
_HUBS_LOCK = threading.Lock()


def _hub(address: str) -> _Hub:
    with _HUBS_LOCK:
        return _HUBS.setdefault(address, _Hub())


def _copy(frames: Frames) -> list[bytes]:
    return [bytes(frame) for frame in frames]  # the sender may reuse its buffers


class LoopbackPeer(PeerTransport):
    def __init__(self, address: str, identity: bytes):
        self._hub, self._identity = _hub(address), identity
        self.identity = identity

    def send(self, plane: str, frames: Frames) -> None:
        self._hub.inbox.put((plane, self._identity, _copy(frames)))

    def recv(self, timeout_s: float) -> tuple[str, list[bytes]] | None:
        try:
            return self._hub.outbox(self._identity).get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None

    def close(self) -> None:
        pass


class LoopbackServer(ServerTransport):
    def __init__(self, address: str):
        self._address = address
        self._hub = _hub(address)

    def send(self, plane: str, peer: bytes, frames: Frames) -> bool:
        self._hub.outbox(peer).put((plane, _copy(frames)))
        return True

    def recv(self, timeout_s: float) -> tuple[str, bytes, list[bytes]] | None:
        try:
            return self._hub.inbox.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None

    def close(self) -> None:
        with _HUBS_LOCK:
            if _HUBS.get(self._address) is self._hub:
                del _HUBS[self._address]
