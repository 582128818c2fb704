"""The data plane contract: what each transport implements once per side, and its registry entry.

A link (`afd.connector.attention_link`, `afd.connector.ffn_link`) owns the control plane:
handshake, step plans, heartbeats, reconnects, the peer table. A data plane only moves the
step's tensors; failures come back in results (`Received.failed`, the dicts of
`finish_step`/`fail_step`), never through attributes. A transport is one module under
`afd.connector.transports` exporting `TRANSPORT` (see `afd.connector.registry`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import torch

from afd.connector.base import AttnTransfer, FFNTransfer
from afd.connector.transport import PeerTransport, ServerTransport
from afd.connector.wire import HelloReply


@dataclass(frozen=True)
class DataContract:
    """What every data message must look like, fixed by the handshake."""

    hidden_size: int
    dtype: str
    logit_cols: int


@dataclass(frozen=True)
class PlaneOptions:
    """Where tensors land and how long a peer may keep a transfer waiting."""

    device: torch.device | str
    peer_timeout_s: float


@dataclass(frozen=True)
class Received:
    """One FFN receive: the transfer narrowed to the peers that delivered, their rows, who failed and why."""

    transfer: FFNTransfer
    hidden: torch.Tensor  # [sum(rows), hidden], peers in order
    logits: torch.Tensor | None  # [sum(rows), experts] float32 when the gate runs on attention
    failed: Mapping[bytes, str]


class PeerWatch(Protocol):
    """What the FFN link offers a data plane that waits: read the wire, ask after a peer."""

    def pump(self, timeout_s: float) -> bool: ...

    def peer_problem(self, peer: bytes, silent_after_s: float | None = None) -> str | None: ...


class AttentionPlane(ABC):
    """The attention end of one data plane to one FFN rank."""

    @abstractmethod
    def bind(self, transport: PeerTransport, reply: HelloReply, pump: Callable[[float], None], timeout_s: float) -> None:
        """Use the connection just handshaken (`pump(timeout)` reads it); raises `HandshakeError`."""

    @abstractmethod
    def begin_step(self, step_id: int) -> None:
        """A new step starts: what an older one left behind goes."""

    @abstractmethod
    def accept(self, frames: list[bytes]) -> None:
        """Data frames the connection delivered; raises `PeerLost` on a malformed message."""

    @abstractmethod
    def send(self, hidden: torch.Tensor, transfer: AttnTransfer, router_logits: torch.Tensor | None) -> None: ...

    @abstractmethod
    def recv(self, transfer: AttnTransfer) -> torch.Tensor:
        """The FFN output [tokens, hidden] of `transfer`; raises `PeerLost` past the peer timeout."""

    def issue_sends(self) -> None:
        """Issue what `send` still holds now rather than with the next receive (an expert-parallel
        link does this for every shard before awaiting any, so the shards compute in parallel)."""

    @abstractmethod
    def end_step(self) -> object | None:
        """Mark the end of the step just launched (its work may still be running); `finish_step` waits for it."""

    @abstractmethod
    def finish_step(self, mark: object | None, tick: Callable[[], None]) -> None:
        """Return once the step of `mark` (from `end_step`; None: everything launched so far) is done,
        calling `tick` while waiting; raises `PeerLost`, also for a step the lost connection cut short."""

    @abstractmethod
    def abort(self) -> None:
        """Drop what the lost connection still holds."""

    @abstractmethod
    def close(self) -> None: ...


class FFNPlane(ABC):
    """The FFN end of one data plane: every attention peer of one FFN rank."""

    @abstractmethod
    def admit(self, peer: bytes) -> dict:
        """A peer passed the handshake; returns extra HelloReply fields."""

    @abstractmethod
    def forget(self, peer: bytes, graceful: bool) -> None:
        """Everything held for `peer` goes (`graceful`: it said Goodbye)."""

    @abstractmethod
    def accept(self, peer: bytes, frames: list[bytes]) -> str | None:
        """Data frames from an admitted peer; returns why they were rejected, or None."""

    @abstractmethod
    def recv(self, transfer: FFNTransfer, watch: PeerWatch, stop: Callable[[], bool]) -> Received:
        """Every peer's rows of `transfer`; raises `Interrupted` once `stop()` is true."""

    @abstractmethod
    def send(self, output: torch.Tensor, transfer: FFNTransfer) -> None:
        """Split [sum(rows), hidden] back into each peer's rows and return them."""

    @abstractmethod
    def flush(self) -> None:
        """Issue what `send` still holds: the last call of a step's body, so a captured step replays it."""

    @abstractmethod
    def finish_step(self, peers: tuple[bytes, ...], watch: PeerWatch) -> dict[bytes, str]:
        """Wait for the step's transfers; returns the peers that failed it, with why."""

    @abstractmethod
    def fail_step(self, peers: tuple[bytes, ...], error: str, watch: PeerWatch) -> dict[bytes, str]:
        """A transfer of the step raised: the peers to drop, with why."""

    @abstractmethod
    def close(self) -> None: ...


class Interrupted(Exception):
    """The FFN rank is shutting down; raised out of a blocked receive."""


@dataclass(frozen=True)
class Transport:
    """A registry entry: how to open each end, the data plane of each side, and what the transport can do
    (asked instead of its name)."""

    open_peer: Callable[..., PeerTransport]  # (LinkSettings, ffn endpoint (GroupSettings.ffn_endpoint), identity)
    open_server: Callable[..., ServerTransport]  # (LinkSettings, this FFN process's endpoint)
    attention_plane: Callable[[PlaneOptions], AttentionPlane]
    ffn_plane: Callable[[PlaneOptions, DataContract, ServerTransport], FFNPlane]
    wire_name: str  # the data plane a Hello names (`Hello.connector`): both ends must move tensors the same way
    graph_capturable: bool  # its tensor moves can sit inside a CUDA graph (a host-frame plane's cannot)
