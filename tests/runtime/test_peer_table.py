"""The FFN rank's peer table (afd.connector.peers): who is connected, and which identities were used."""

from afd.connector.peers import PeerTable
from afd.connector.wire import HelloReply


def test_a_removed_peer_is_retired_and_its_reply_and_rank_go():
    table = PeerTable()
    table.add(b"a", 0)
    table.replies[b"a"] = HelloReply(True, 0)
    assert b"a" in table and list(table) == [b"a"] and table.connections_of(0) == [b"a"]
    assert table.remove(b"a") == 0
    assert b"a" not in table and b"a" not in table.replies and b"a" in table.retired
    assert table.remove(b"never") is None and b"never" in table.retired  # a stranger's identity is used up too


def test_retired_identities_are_bounded_oldest_first():
    table = PeerTable(max_retired=2)
    for peer in (b"a", b"b", b"c"):
        table.retire(peer)
    assert list(table.retired) == [b"b", b"c"]


def test_silence_is_counted_only_for_connected_peers():
    table = PeerTable()
    table.heard(b"x")  # not connected: nothing tracked
    assert table.silent_s(b"x") == 0.0
    table.add(b"y", 1)
    assert 0.0 <= table.silent_s(b"y") < 1.0
