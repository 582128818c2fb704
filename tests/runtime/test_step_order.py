"""Shard 0 of an expert-parallel FFN rank orders every shard's steps: it starts none before all shards follow."""

from collections import deque
from types import SimpleNamespace

from afd.runners.step_order import LeaderOrder


class FakeLink:
    """The parts of FFNLink an order uses: queued plans per peer, the followers, control sends."""

    ffn_rank = 0

    def __init__(self):
        self.peers = {b"a0": 0}
        self.queued = {b"a0": deque([SimpleNamespace(step_id=1), SimpleNamespace(step_id=2)])}
        self.followers: dict[bytes, int] = {}
        self.sent: list[tuple[bytes, object]] = []
        self.polls = 0

    def poll(self, timeout_s):
        self.polls += 1

    def next_plans(self):
        return {peer: queue.popleft() for peer, queue in self.queued.items() if queue}

    def has_plans(self):
        return any(self.queued.values())

    def send_control(self, peer, message):
        self.sent.append((peer, message))
        return True


def test_shard_0_runs_no_step_until_every_other_shard_follows():
    link, order = FakeLink(), LeaderOrder(followers=2)
    assert order.take(link) == {} and len(link.queued[b"a0"]) == 2  # nobody follows yet: the plans wait
    link.followers[b"s1"] = 1
    link.followers[b"s1-old"] = 1  # the same shard twice (it reconnected) counts once
    assert order.take(link) == {} and link.polls == 2
    link.followers[b"s2"] = 2
    plans = order.take(link)
    assert [p.step_id for p in plans.values()] == [1]
    assert {peer for peer, _ in link.sent} == {b"s1", b"s1-old", b"s2"}
    assert all(message.step_ids == (1,) and message.attention_ranks == (0,) for _, message in link.sent)
