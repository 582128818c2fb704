"""Frame transports under the connector: a peer side (attention) and a server side (FFN).

Two planes share one link: `control` (small msgpack messages) and `data` (a header
frame plus tensor frames). A transport only moves lists of byte frames; the links and
data planes above it give them meaning (`afd.connector.transports` names them).
"""

from __future__ import annotations

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
