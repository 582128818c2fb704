"""pyzmq transport: DEALER sockets on attention, ROUTER sockets on the FFN, one pair per plane.

Plain TCP: works on any network, CPU or GPU. Every connection has its own identity
(`afd.connector.identity`), so the ROUTER never hands a live identity over to a second
connection: a process that only knows a rank number cannot take a route over.
ROUTER_MANDATORY turns a send to a vanished peer into an error instead of a silent
drop (the FFN probes peers that way); MAXMSGSIZE stops absurd frames at the socket,
before they cost memory. The attention end watches its control connection: when the
FFN's end of it closes (the process died), `recv` reports the plane `down` at once
instead of waiting out a timeout.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from afd.connector.transport import PLANES, Frames, PeerTransport, ServerTransport


class ZmqPeer(PeerTransport):
    def __init__(self, host: str, ports: tuple[int, int], identity: bytes):
        self.identity = identity
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
        self._monitor = self._sockets["control"].get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller.register(self._monitor, zmq.POLLIN)

    def send(self, plane: str, frames: Frames) -> None:
        self._sockets[plane].send_multipart(list(frames), copy=False)

    def recv(self, timeout_s: float) -> tuple[str, list[bytes]] | None:
        ready = dict(self._poller.poll(int(max(timeout_s, 0.0) * 1000)))
        for plane in PLANES:  # control first: a Goodbye must not wait behind data
            if self._sockets[plane] in ready:
                return plane, self._sockets[plane].recv_multipart()
        if self._monitor in ready:
            event = recv_monitor_message(self._monitor)
            return "down", [f"the connection to {event.get('endpoint', b'?').decode(errors='replace')} closed".encode()]
        return None

    def close(self) -> None:
        self._sockets["control"].disable_monitor()
        self._monitor.close(linger=0)
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
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            socket.setsockopt(zmq.MAXMSGSIZE, 64 * 1024 if plane == "control" else max_message_bytes)
            socket.bind(f"tcp://{bind_host}:{port}")
            self._sockets[plane] = socket
            self._poller.register(socket, zmq.POLLIN)

    def send(self, plane: str, peer: bytes, frames: Frames) -> bool:
        try:  # never blocks on a vanished peer: ROUTER_MANDATORY raises EHOSTUNREACH
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
