"""Which attention ranks' plans an FFN step runs: decided locally, or, for an expert-parallel rank,
by its shard 0 for every shard.

Without expert parallelism an FFN rank takes the plans that are ready (`LocalOrder`). With G
shards that would deadlock: if shard 0 batched attention ranks a0 and a1 into one step while
shard 1 ran a0 alone, a1 would wait on shard 1 (busy with a0's step) while shard 0 waits for
a1's next layer, and a0, needing both shards' sums, stalls too. So shard 0 decides (`LeaderOrder`)
and sends each step's composition to the other shards as a `wire.StepOrder`; they run exactly
those plans in that order (`FollowerOrder`). The plans themselves still come to every shard from
the attention ranks; only the composition travels between shards, over the control plane.
Shard 0 starts no step until every other shard has said it follows: a step that one shard
does not run cannot end (the attention rank needs every shard's partial sum), and pods start in
any order, so shard 1 may say hello after the first plan reached shard 0.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from afd.config import GroupSettings, LinkSettings
from afd.connector import registry, wire
from afd.connector.ffn_link import FFNLink
from afd.connector.identity import identity_key, new_identity
from afd.runners.handshake import token_digest

log = logging.getLogger(__name__)
POLL_INTERVAL_S = 0.1
WAIT_SLICE_S = 0.005  # a follower with an order waits in slices this long for its plans
HELLO_INTERVAL_S = 1.0  # a follower repeats its ShardHello, so a restarted shard 0 learns of it


class LocalOrder:
    """The plans that are ready; with a batch window, the other connected peers' too."""

    def __init__(self, batch_window_s: float = 0.0):
        self.batch_window_s = batch_window_s

    def take(self, link: FFNLink) -> dict:
        link.poll(0.0 if link.has_plans() else POLL_INTERVAL_S)
        plans = link.next_plans()
        if plans and self.batch_window_s:
            link.gather_more(plans, self.batch_window_s)
        return plans

    def close(self) -> None:
        pass


class LeaderOrder(LocalOrder):
    """Shard 0: decides like `LocalOrder` and tells the other shards, once all `followers` of them follow."""

    def __init__(self, batch_window_s: float = 0.0, followers: int = 1):
        super().__init__(batch_window_s)
        self.expected_followers = followers

    def take(self, link: FFNLink) -> dict:
        if len(set(link.followers.values())) < self.expected_followers:
            link.poll(POLL_INTERVAL_S)  # hellos, handshakes; the plans wait in their queues
            return {}
        plans = super().take(link)
        if plans and link.followers:
            order = wire.StepOrder(tuple(link.peers[p] for p in plans), tuple(plan.step_id for plan in plans.values()))
            for follower in list(link.followers):
                if not link.send_control(follower, order):
                    log.warning("shard %d of ffn rank %d is gone", link.followers.pop(follower), link.ffn_rank)
        return plans


class FollowerOrder:
    """Shard s > 0: runs shard 0's steps, in its order, with the plans the attention ranks sent here."""

    def __init__(self, group: GroupSettings, link: LinkSettings):
        self.shard = group.ffn_shard
        key = identity_key(group.group_token, group.group_secret)
        leader = group.ffn_endpoint(group.rank, 0)
        self.transport = registry.transport(link.connector).open_peer(link, leader, new_identity(group.ffn_shard, key))
        self.hello = wire.ShardHello(group.ffn_shard, group.ffn_expert_parallel,
                                     token_digest(group.group_token, group.group_secret))
        self.orders: deque[wire.StepOrder] = deque()
        self.wait_s = link.peer_timeout_s  # an ordered plan that never comes is skipped after this
        self._hello_at = 0.0
        self._order_since = 0.0

    def take(self, link: FFNLink) -> dict:
        now = time.monotonic()
        if now - self._hello_at >= HELLO_INTERVAL_S:
            self.transport.send("control", [wire.encode(self.hello)])
            self._hello_at = now
        while link.pump(0.0):  # what the attention ranks sent (a Hello, plans); handled below
            pass
        link.poll(0.0)
        self._read(0.0 if self.orders else POLL_INTERVAL_S)
        if not self.orders:
            return {}
        order = self.orders[0]
        by_rank = {rank: peer for peer, rank in link.peers.items()}
        ready, missing = {}, []
        for rank, step in zip(order.attention_ranks, order.step_ids):
            peer = by_rank.get(rank)
            queue = link.queued.get(peer) if peer is not None else None
            while queue and queue[0].step_id < step:  # a plan shard 0 never ran (its peer reconnected there)
                queue.popleft()
            if queue and queue[0].step_id == step:
                ready[peer] = queue
            elif peer is not None:
                missing.append(rank)
        if missing and time.monotonic() - self._order_since < self.wait_s:
            link.poll(WAIT_SLICE_S)  # the plan is on its way from the attention rank
            return {}
        if missing:
            log.warning("shard %d: no plan from attention ranks %s for shard 0's step; running without them",
                        self.shard, missing)
        self.orders.popleft()
        self._order_since = time.monotonic()
        return {peer: queue.popleft() for peer, queue in ready.items()}

    def _read(self, timeout_s: float) -> None:
        while (received := self.transport.recv(timeout_s)) is not None:
            timeout_s = 0.0
            plane, frames = received
            if plane != "control":
                continue
            try:
                message = wire.decode(frames[0])
            except wire.ProtocolError as err:
                log.warning("ignoring a message from shard 0: %s", err)
                continue
            if isinstance(message, wire.StepOrder):
                if not self.orders:
                    self._order_since = time.monotonic()
                self.orders.append(message)

    def close(self) -> None:
        self.transport.close()


def step_order(group: GroupSettings, link: LinkSettings):
    """How FFN process `group.rank` (shard `group.ffn_shard`) picks each step's plans."""
    if group.ffn_expert_parallel == 1:
        return LocalOrder(link.ffn_batch_window_s)
    if group.ffn_shard == 0:
        return LeaderOrder(link.ffn_batch_window_s, group.ffn_expert_parallel - 1)
    return FollowerOrder(group, link)
