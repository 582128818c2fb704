"""An FFN rank's preStop drain never ends in the middle of a step (found by the real-node e2e on a starved CPU).

The drain ends when every attention peer has left, or, for peers that never leave, once no step has run or
begun for `DRAIN_QUIET_S`. It used to count that quiet time from the last plan received: a step slower than it
(seconds on a loaded 2-CPU node) was cut mid-way, the link closed under the attention ranks' running requests
and they were held until the FFN pod's successor came, past the clients' timeouts.
"""

from __future__ import annotations

import time

from afd.connector import ffn_link
from afd.connector.ffn_link import FFNLink


def _draining_link(monkeypatch) -> FFNLink:
    monkeypatch.setattr(ffn_link, "DRAIN_NOTICE_S", 0.0)
    monkeypatch.setattr(ffn_link, "DRAIN_QUIET_S", 0.2)
    link = FFNLink(None, None, None, (0,), 0, b"group key")  # transport and plane unused by the drain
    link.table.add(b"attn-0", 0)  # a peer that has not left
    link.request_drain()
    return link


def test_a_step_slower_than_the_quiet_time_is_not_cut_by_the_drain(monkeypatch):
    link = _draining_link(monkeypatch)
    with link.running_step():
        time.sleep(0.3)  # longer than DRAIN_QUIET_S since anything arrived
        assert not link.drained()
    assert not link.drained()  # the quiet time starts at the step's end
    time.sleep(0.3)
    assert link.drained()


def test_a_peer_that_never_leaves_ends_the_drain_after_the_quiet_time(monkeypatch):
    link = _draining_link(monkeypatch)
    time.sleep(0.3)
    assert link.drained()
    link.table.ranks.clear()
    assert link.drained()  # every peer left
