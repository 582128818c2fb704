"""`loopback`: both ends in one process over in-process queues (tests, `afd generate --connector loopback`)."""

from __future__ import annotations

import queue
import threading

from afd.config import LinkSettings
from afd.connector.host_plane import HostAttentionPlane, HostFFNPlane
from afd.connector.plane import Transport
from afd.connector.transport import Frames, PeerTransport, ServerTransport


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


def address(link: LinkSettings, endpoint: int) -> str:
    return f"{link.ffn_host(endpoint)}:{link.ffn_ports(endpoint)[0]}"


def open_peer(link: LinkSettings, endpoint: int, identity: bytes) -> LoopbackPeer:
    """A connection to FFN process `endpoint` (`GroupSettings.ffn_endpoint`)."""
    return LoopbackPeer(address(link, endpoint), identity)


def open_server(link: LinkSettings, endpoint: int) -> LoopbackServer:
    """FFN process `endpoint`'s end."""
    return LoopbackServer(address(link, endpoint))


TRANSPORT = Transport(open_peer, open_server, HostAttentionPlane, HostFFNPlane, wire_name="host", graph_capturable=False)
