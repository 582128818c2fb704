"""`zmq`: both planes over pyzmq sockets (`afd.connector.zmq_transport`), tensors as host frames."""

from __future__ import annotations

from afd.config import AFDConfig
from afd.connector.host_plane import HostAttentionPlane, HostFFNPlane
from afd.connector.plane import Transport
from afd.connector.zmq_transport import ZmqPeer, ZmqServer


def open_peer(config: AFDConfig, ffn_rank: int, identity: bytes) -> ZmqPeer:
    return ZmqPeer(config.ffn_host(ffn_rank), config.ffn_ports(ffn_rank), identity)


def open_server(config: AFDConfig) -> ZmqServer:
    return ZmqServer(config.bind_host, config.ffn_ports(config.rank), config.max_message_bytes)


TRANSPORT = Transport(open_peer, open_server, HostAttentionPlane, HostFFNPlane)
