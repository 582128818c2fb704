"""The FFN rank's table of attention connections (`afd.connector.ffn_link` handles their messages).

A connection identity maps to the attention rank it handshook as; the table also keeps what
each live connection was answered (a repeated Hello gets the same reply), when each was last
heard, and the identities of closed connections, so a replayed Hello is refused.
"""

from __future__ import annotations

import time
from typing import Iterator

from afd.connector.wire import HelloReply

MAX_RETIRED = 4096  # connection identities remembered as used, so a replayed Hello is refused


class PeerTable:
    """Connection identity → attention rank, with replies, last-heard times and retired identities."""

    def __init__(self, max_retired: int = MAX_RETIRED):
        self.ranks: dict[bytes, int] = {}  # connection identity → attention rank
        self.replies: dict[bytes, HelloReply] = {}  # what each live connection was answered: a repeat gets it again
        self.retired: dict[bytes, None] = {}  # identities of closed connections, oldest first
        self.max_retired = max_retired
        self._heard: dict[bytes, float] = {}  # peer → when it last sent anything

    def __contains__(self, peer: bytes) -> bool:
        return peer in self.ranks

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.ranks)

    def __len__(self) -> int:
        return len(self.ranks)

    def add(self, peer: bytes, rank: int) -> None:
        """`peer` passed the handshake as attention rank `rank`."""
        self.ranks[peer] = rank
        self._heard[peer] = time.monotonic()

    def heard(self, peer: bytes) -> None:
        """`peer` sent something (only connected peers are tracked)."""
        if peer in self._heard:
            self._heard[peer] = time.monotonic()

    def silent_s(self, peer: bytes) -> float:
        """Seconds since `peer` last sent anything (0 for a peer not connected)."""
        heard = self._heard.get(peer)
        return 0.0 if heard is None else time.monotonic() - heard

    def connections_of(self, rank: int) -> list[bytes]:
        return [peer for peer, peer_rank in self.ranks.items() if peer_rank == rank]

    def retire(self, peer: bytes) -> None:
        """Remember `peer` as used, forgetting the oldest past `max_retired`."""
        self.retired[peer] = None
        while len(self.retired) > self.max_retired:
            del self.retired[next(iter(self.retired))]

    def remove(self, peer: bytes) -> int | None:
        """Forget `peer` and retire its identity; returns its rank if it was connected."""
        rank = self.ranks.pop(peer, None)
        self.replies.pop(peer, None)
        self._heard.pop(peer, None)
        self.retire(peer)
        return rank
