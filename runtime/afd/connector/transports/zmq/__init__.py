"""`zmq`: both planes over pyzmq sockets (`afd.connector.transports.zmq.sockets`), tensors as host frames."""

from __future__ import annotations

from afd.config import LinkSettings
from afd.connector.host_plane import HostAttentionPlane, HostFFNPlane
from afd.connector.plane import Transport
from afd.connector.transports.zmq.sockets import ZmqPeer, ZmqServer


def open_peer(link: LinkSettings, endpoint: int, identity: bytes) -> ZmqPeer:
    """A connection to FFN process `endpoint` (`GroupSettings.ffn_endpoint`)."""
    return ZmqPeer(link.ffn_host(endpoint), link.ffn_ports(endpoint), identity)


def open_server(link: LinkSettings, endpoint: int) -> ZmqServer:
    """FFN process `endpoint`'s end, on `bind_host`."""
    return ZmqServer(link.bind_host, link.ffn_ports(endpoint), link.max_message_bytes)


TRANSPORT = Transport(open_peer, open_server, HostAttentionPlane, HostFFNPlane, wire_name="host", graph_capturable=False)
