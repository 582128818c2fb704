import pytest

from afd.config.topology import Topology, TopologyError, crossing_layers


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2A2F", {0: 0, 1: 1}),
        ("4A2F", {0: 0, 1: 0, 2: 1, 3: 1}),
        ("2A1F", {0: 0, 1: 0}),
        ("3A2F", {0: 0, 1: 0, 2: 1}),
        ("5A3F", {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}),
        ("1a1f", {0: 0}),
    ],
)
def test_attention_to_ffn_mapping(text, expected):
    topology = Topology.parse(text)
    assert {a: topology.ffn_rank_of(a) for a in range(topology.num_attention)} == expected


def test_divisible_mapping_is_the_seed_rule():
    for a_count, f_count in [(4, 2), (8, 4), (6, 3), (8, 2)]:
        topology = Topology(a_count, f_count)
        assert [topology.ffn_rank_of(a) for a in range(a_count)] == [a // (a_count // f_count) for a in range(a_count)]


def test_blocks_are_balanced_contiguous_and_cover_every_rank():
    for a_count in range(1, 13):
        for f_count in range(1, a_count + 1):
            topology = Topology(a_count, f_count)
            blocks = [topology.attention_ranks_of(f) for f in range(f_count)]
            assert [a for block in blocks for a in block] == list(range(a_count))
            sizes = [len(block) for block in blocks]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.parametrize("text", ["1A2F", "0A1F", "2B1F", "", "A1F", "2A0F", "-1A1F"])
def test_bad_topologies_are_refused_with_the_value(text):
    with pytest.raises(TopologyError) as err:
        Topology.parse(text)
    assert text in str(err.value) or "A >= F" in str(err.value) or "FFN rank" in str(err.value)


def test_rank_out_of_range():
    with pytest.raises(TopologyError, match="attention rank 4"):
        Topology(4, 2).ffn_rank_of(4)


def test_crossing_layers_follow_gate_placement():
    moe = [False, True, True, False, True]
    assert crossing_layers(moe, gate_on_attention=False) == (0, 1, 2, 3, 4)
    assert crossing_layers(moe, gate_on_attention=True) == (1, 2, 4)
