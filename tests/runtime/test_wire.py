"""Control messages round-trip; anything else is a ProtocolError that says why."""

import msgpack
import pytest

from afd.connector import wire

MESSAGES = [
    wire.Hello(1, "2A1F", "abc", (0, 1, 2), 64, "float32", 2, True, 8, "d"),
    wire.HelloReply(False, 0, "nope"),
    wire.StepPlan(7, (3, 0), warmup=True, replay=True),
    wire.Heartbeat(4),
    wire.Goodbye("bye"),
    wire.Draining("pod deleted"),
    wire.DataHeader(1, 2, 1, 5, 64, "bfloat16", 8),
]


@pytest.mark.parametrize("message", MESSAGES)
def test_round_trip(message):
    assert wire.decode(wire.encode(message)) == message


def pack(body):
    return msgpack.packb(body)


@pytest.mark.parametrize(
    "data, error",
    [
        (b"\x00\x01garbage", "undecodable|expected a map"),
        (pack([1, 2, 3]), "expected a map"),
        (pack({"v": 99, "t": "heartbeat", "seq": 1}), "protocol version 99"),
        (pack({"v": 1, "t": "pickle", "x": 1}), "unknown message type 'pickle'"),
        (pack({"v": 1, "t": "heartbeat", "seq": "1"}), "heartbeat.seq: expected int"),
        (pack({"v": 1, "t": "heartbeat", "seq": 1, "extra": 2}), "unknown fields"),
        (pack({"v": 1, "t": "step_plan", "step_id": 1}), "stage_tokens"),
        (pack({"v": 1, "t": "step_plan", "step_id": 1, "stage_tokens": [1, "x"]}), "list of integers"),
        (pack({"v": 1, "t": "heartbeat", "seq": 2**63}), "out of range"),
        (b"\x00" * (wire.MAX_CONTROL_BYTES + 1), "exceeds"),
    ],
)
def test_garbage_is_a_protocol_error(data, error):
    with pytest.raises(wire.ProtocolError, match=error):
        wire.decode(data)


def test_bool_is_not_an_int():
    with pytest.raises(wire.ProtocolError):
        wire.decode(pack({"v": 1, "t": "heartbeat", "seq": True}))
