"""Connector errors and the transfer contexts both roles pass around."""

from __future__ import annotations

from dataclasses import dataclass


class ConnectorError(RuntimeError):
    """The link to a peer cannot be used."""


class HandshakeError(ConnectorError):
    """The FFN refused the connection, or never answered; the text says why."""


class PeerLost(ConnectorError):
    """A peer said goodbye, stopped answering, or sent something unusable."""


class PeerLeft(PeerLost):
    """A peer said goodbye: it stopped on purpose (a planned stop or restart), not a failure."""


@dataclass(frozen=True)
class AttnTransfer:
    """Attention side: one (step, layer, stage) exchange with its FFN rank."""

    step_id: int
    layer: int
    stage: int


@dataclass(frozen=True)
class FFNTransfer:
    """FFN side: one (layer, stage) exchange with several peers, rows concatenated in peer order."""

    layer: int
    stage: int
    peers: tuple[bytes, ...]
    steps: tuple[int, ...]
    rows: tuple[int, ...]

    def only(self, peers: set[bytes]) -> "FFNTransfer":
        keep = [i for i, peer in enumerate(self.peers) if peer in peers]
        return FFNTransfer(
            self.layer,
            self.stage,
            tuple(self.peers[i] for i in keep),
            tuple(self.steps[i] for i in keep),
            tuple(self.rows[i] for i in keep),
        )
