"""`nccl`: the control plane over zmq, tensors over one NCCL pair per attention/FFN connection (GPU)."""

from __future__ import annotations

from afd.connector.transports.nccl.attention import NcclAttentionPlane
from afd.connector.transports.nccl.ffn import NcclFFNPlane
from afd.connector.plane import Transport
from afd.connector.transports.zmq import open_peer, open_server

TRANSPORT = Transport(open_peer, open_server, NcclAttentionPlane, NcclFFNPlane, wire_name="nccl", graph_capturable=True)
