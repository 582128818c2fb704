"""Lazy connector factory: a connector name picks the transport; nothing is imported early."""

from __future__ import annotations

import importlib

import torch

from afd.config import AFDConfig
from afd.connector.attention_side import AttentionConnector
from afd.connector.base import ConnectorError
from afd.connector.ffn_side import DataContract, FFNConnector
from afd.connector.identity import identity_key, new_identity

# name → (module, attention-side factory, FFN-side factory)
_REGISTRY = {
    "loopback": ("afd.connector.factory", "_loopback_peer", "_loopback_server"),
    "zmq": ("afd.connector.factory", "_zmq_peer", "_zmq_server"),
}
# connectors whose data plane is not a frame transport (control plane on zmq):
# name → (module, attention connector class, FFN factory)
_CONNECTORS = {
    "nccl": ("afd.connector.nccl", "NcclAttentionConnector", "make_ffn_connector"),
}


def _resolve(name: str, side: int):
    registry = _CONNECTORS if name in _CONNECTORS else _REGISTRY
    if name not in registry:
        raise ConnectorError(f"connector {name!r} is unknown (known: {', '.join([*_REGISTRY, *_CONNECTORS])})")
    module_name = registry[name][0]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConnectorError(f"connector {name!r} is not available here: {err}") from None
    return getattr(module, registry[name][side])


def loopback_address(config: AFDConfig, ffn_rank: int) -> str:
    return f"{config.ffn_host(ffn_rank)}:{config.ffn_ports(ffn_rank)[0]}"


def _loopback_peer(config: AFDConfig, ffn_rank: int, identity: bytes):
    from afd.connector.transport import LoopbackPeer

    return LoopbackPeer(loopback_address(config, ffn_rank), identity)


def _loopback_server(config: AFDConfig):
    from afd.connector.transport import LoopbackServer

    return LoopbackServer(loopback_address(config, config.rank))


def _zmq_peer(config: AFDConfig, ffn_rank: int, identity: bytes):
    from afd.connector.zmq_transport import ZmqPeer

    return ZmqPeer(config.ffn_host(ffn_rank), config.ffn_ports(ffn_rank), identity)


def _zmq_server(config: AFDConfig):
    from afd.connector.zmq_transport import ZmqServer

    return ZmqServer(config.bind_host, config.ffn_ports(config.rank), config.max_message_bytes)


def peer_identity(config: AFDConfig) -> bytes:
    """A fresh identity for one connection of attention rank `config.rank` (`afd.connector.identity`)."""
    return new_identity(config.rank, identity_key(config.group_token, config.group_secret))


def make_attention_connector(config: AFDConfig, device: torch.device | str) -> AttentionConnector:
    """The connector of attention rank `config.rank` to the FFN rank that serves it.

    Every connection, the first and each one `reconnect` opens, has its own identity.
    """
    ffn_rank = config.topology.ffn_rank_of(config.rank)
    if config.connector in _CONNECTORS:
        open_transport = _zmq_peer  # connectors of their own keep the control plane on zmq
        connector = _resolve(config.connector, 1)(open_transport(config, ffn_rank, peer_identity(config)), ffn_rank, device,
                                                   config.peer_timeout_s)
    else:
        open_transport = _resolve(config.connector, 1)
        connector = AttentionConnector(open_transport(config, ffn_rank, peer_identity(config)), ffn_rank, device,
                                       config.peer_timeout_s)
    connector.heartbeat_interval_s = config.heartbeat_interval_s
    connector.reopen = lambda: open_transport(config, ffn_rank, peer_identity(config))
    return connector


def make_ffn_connector(config: AFDConfig, device: torch.device | str, contract: DataContract) -> FFNConnector:
    """The listening connector of FFN rank `config.rank`."""
    if config.connector in _CONNECTORS:
        return _resolve(config.connector, 2)(config, device, contract)
    transport = _resolve(config.connector, 2)(config)
    return FFNConnector(transport, device, config.peer_timeout_s, contract)
