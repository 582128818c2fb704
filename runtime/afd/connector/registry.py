"""The one transport registry: the `connector` setting names a module of `afd.connector.transports`.

Each such module exports `TRANSPORT` (`afd.connector.plane.Transport`): how to open each
end and the data plane of each side. Adding a transport is one file there (and its name in
`afd.config.CONNECTORS`, the torch-free list the configuration is checked against).
Nothing is imported before a transport is asked for.
"""

from __future__ import annotations

import importlib

from afd.config import CONNECTORS, GroupSettings
from afd.connector.base import ConnectorError
from afd.connector.identity import identity_key, new_identity
from afd.connector.plane import Transport


def transport(name: str) -> Transport:
    """The registry entry of transport `name`; `ConnectorError` when unknown or not installed here."""
    if name not in CONNECTORS:
        raise ConnectorError(f"connector {name!r} is unknown (known: {', '.join(CONNECTORS)})")
    try:
        module = importlib.import_module(f"afd.connector.transports.{name}")
    except ImportError as err:
        raise ConnectorError(f"connector {name!r} is not available here: {err}") from None
    return module.TRANSPORT


def peer_identity(group: GroupSettings) -> bytes:
    """A fresh identity for one connection of attention rank `group.rank` (`afd.connector.identity`)."""
    return new_identity(group.rank, identity_key(group.group_token, group.group_secret))
