"""pyzmq transport: DEALER sockets on attention, ROUTER sockets on the FFN, one pair per plane.

Plain TCP: works on any network, CPU or GPU. ROUTER_HANDOVER lets a restarted
attention rank reclaim its identity; ROUTER_MANDATORY turns a send to a vanished
peer into an error instead of a silent drop; MAXMSGSIZE stops absurd frames at the
socket, before they cost memory.
"""

from __future__ import annotations

import zmq

from afd.connector.transport import PLANES, Frames, PeerTransport, ServerTransport


class ZmqPeer(PeerTransport):
    def __init__(self, host: str, ports: tuple[int, int], identity: bytes):
        self._context = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}
        self._poller = zmq.Poller()
        for plane, port in zip(PLANES, ports):
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.IDENTITY, identity)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(f"tcp://{host}:{port}")
            self._sockets[plane] = socket
            self._poller.register(socket, zmq.POLLIN)

    def send(self, plane: str, frames: Frames) -> None:
        self._sockets[plane].send_multipart(list(frames), copy=False)

    def recv(self, timeout_s: float) -> tuple[str, list[bytes]] | None:
        ready = dict(self._poller.poll(int(max(timeout_s, 0.0) * 1000)))
        for plane in PLANES:  # control first: a Goodbye must not wait behind data
            if self._sockets[plane] in ready:
                return plane, self._sockets[plane].recv_multipart()
        return None

    def close(self) -> None:
        for socket in self._sockets.values():
            socket.close(linger=0)
        self._context.term()


class ZmqServer(ServerTransport):
    def __init__(self, bind_host: str, ports: tuple[int, int], max_message_bytes: int):
        self._context = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}
        self._poller = zmq.Poller()
        for plane, port in zip(PLANES, ports):
            socket = self._context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            socket.setsockopt(zmq.MAXMSGSIZE, 64 * 1024 if plane == "control" else max_message_bytes)
            socket.bind(f"tcp://{bind_host}:{port}")
            self._sockets[plane] = socket
            self._poller.register(socket, zmq.POLLIN)

    def send(self, plane: str, peer: bytes, frames: Frames) -> bool:
        try:
            self._sockets[plane].send_multipart([peer, *frames], copy=False)
            return True
        except zmq.error.ZMQError:  # EHOSTUNREACH: the peer is gone
            return False

    def recv(self, timeout_s: float) -> tuple[str, bytes, list[bytes]] | None:
        ready = dict(self._poller.poll(int(max(timeout_s, 0.0) * 1000)))
        for plane in PLANES:
            if self._sockets[plane] in ready:
                peer, *frames = self._sockets[plane].recv_multipart()
                return plane, peer, frames
        return None

    def close(self) -> None:
        for socket in self._sockets.values():
            socket.close(linger=0)
        self._context.term()
