"""The attention side of an expert-parallel FFN rank: one link per shard, used as one link.

Dispatch and combine happen here (afd-plugin's A2E/E2A, done by the attention rank): every
shard gets the same step plan and all rows of every crossing layer, computes its partial FFN
output (its routed experts and its columns of the shared and dense MLPs,
`afd.models.expert_shard`), and the attention rank sums the G partials. Every shape follows
from the plan, so the exchange is capturable in a CUDA graph on NCCL, and each shard is an
ordinary FFN peer: handshake, heartbeats, drain and recovery are those of `AttentionLink`.
A lost shard fails the step with `PeerLost` naming it; `recover` re-handshakes every shard.
"""

from __future__ import annotations

import dataclasses

import torch

from afd.config import GroupSettings, LinkSettings
from afd.connector import wire
from afd.connector.attention_link import AttentionLink, LinkListener, LinkOptions
from afd.connector.base import AttnTransfer, ConnectorError, PeerLost


class ShardedLink:
    """An attention rank's links to the G shards of its FFN rank, with `AttentionLink`'s interface."""

    def __init__(self, links: list[AttentionLink]):
        self.links = links
        for link in links:  # shards return float32 partial sums (afd.models.expert_shard)
            link.plane.return_dtype = torch.float32
        self.ffn_rank = links[0].ffn_rank
        self.shards = len(links)
        self.recover_attempts = self.recover_failures = 0
        self._listeners: list[LinkListener] = []

    @classmethod
    def connect(cls, group: GroupSettings, settings: LinkSettings, hello: wire.Hello, device: torch.device | str,
                options: LinkOptions | None = None) -> "ShardedLink":
        """Open and handshake every shard (`HandshakeError` naming the shard; nothing is left open then)."""
        links: list[AttentionLink] = []
        try:
            for shard in range(group.ffn_expert_parallel):
                shard_hello = dataclasses.replace(hello, ffn_shard=shard)
                links.append(AttentionLink.connect(group, settings, shard_hello, device, options, shard))
        except Exception:
            for link in links:
                link.close("another shard refused the connection")
            raise
        return cls(links)

    @property
    def step_id(self) -> int:
        return self.links[0].step_id

    @property
    def ffn_draining(self) -> str | None:
        return next((link.ffn_draining for link in self.links if link.ffn_draining), None)

    def listen(self, listener: LinkListener) -> None:
        self._listeners.append(listener)

    def _each(self, call) -> None:
        """`call(link)` on every shard; a `PeerLost` names the shard."""
        for shard, link in enumerate(self.links):
            try:
                call(link)
            except PeerLost as err:
                raise PeerLost(f"shard {shard} of {len(self.links)}: {err}") from None

    # -- control plane ---------------------------------------------------------
    def send_plan(self, plan: wire.StepPlan) -> None:
        self._each(lambda link: link.send_plan(plan))

    def tick(self) -> None:
        self._each(AttentionLink.tick)

    def keepalive(self) -> None:
        self._each(AttentionLink.keepalive)

    def recover(self) -> None:
        """Re-handshake every shard on new connections; the decode graphs go first and come back last."""
        self.recover_attempts += 1
        try:
            for link in self.links:
                link.plane.abort()  # stuck transfers end before the graphs holding them are released
            for listener in self._listeners:
                listener.on_link_lost()
            for shard, link in enumerate(self.links):
                try:
                    link.recover()
                except ConnectorError as err:
                    raise type(err)(f"shard {shard} of {len(self.links)}: {err}") from None
            for listener in self._listeners:
                listener.on_link_back()
        except Exception:
            self.recover_failures += 1
            raise

    def leave_if_done(self, idle: bool) -> bool:
        left = [link.leave_if_done(idle) for link in self.links]
        return any(left)

    def close(self, reason: str = "shutdown") -> None:
        for link in self.links:
            link.close(reason)

    # -- data plane: dispatch and combine --------------------------------------
    def send(self, hidden: torch.Tensor, transfer: AttnTransfer, router_logits: torch.Tensor | None = None) -> None:
        """Dispatch: every shard gets all rows (and router logits) of the layer and stage."""
        self._each(lambda link: link.send(hidden, transfer, router_logits))

    def recv(self, transfer: AttnTransfer) -> torch.Tensor:
        """Combine: the sum of the shards' float32 partial outputs [tokens, hidden] (the caller rounds it
        once, to its own dtype).

        Every shard's rows leave before any output is awaited (on NCCL a send otherwise waits for its
        own pair's next receive, and shard s would get its rows only once shard s-1 had answered)."""
        self._each(lambda link: link.plane.issue_sends())
        parts: list[torch.Tensor] = []
        self._each(lambda link: parts.append(link.recv(transfer)))
        total = parts[0].float()
        for part in parts[1:]:
            total = total + part.float()
        return total

    def end_step(self) -> list:
        """Every shard's end-of-step mark, for `wait_step`."""
        return [link.end_step() for link in self.links]

    def wait_step(self, mark: list | None = None) -> None:
        """Return once every shard finished the step of `mark` (every step so far when None); a
        `PeerLost` names the shard."""
        marks = mark if mark is not None else [None] * len(self.links)
        for shard, (link, shard_mark) in enumerate(zip(self.links, marks)):
            try:
                link.wait_step(shard_mark)
            except PeerLost as err:
                raise PeerLost(f"shard {shard} of {len(self.links)}: {err}") from None
