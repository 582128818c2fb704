"""`zmq`: both planes over pyzmq sockets (`afd.connector.transports.zmq.sockets`), tensors as host frames."""

from __future__ import annotations

from afd.config import AFDConfig
from afd.connector.host_plane import HostAttentionPlane, HostFFNPlane
from afd.connector.plane import Transport
from afd.connector.transports.zmq.sockets import ZmqPeer, ZmqServer


def open_peer(config: AFDConfig, endpoint: int, identity: bytes) -> ZmqPeer:
    """A connection to FFN process `endpoint` (`AFDConfig.ffn_endpoint`)."""
    return ZmqPeer(config.ffn_host(endpoint), config.ffn_ports(endpoint), identity)


def open_server(config: AFDConfig) -> ZmqServer:
    endpoint = config.ffn_endpoint(config.rank, config.ffn_shard)
    return ZmqServer(config.bind_host, config.ffn_ports(endpoint), config.max_message_bytes)


TRANSPORT = Transport(open_peer, open_server, HostAttentionPlane, HostFFNPlane, wire_name="host", graph_capturable=False)
