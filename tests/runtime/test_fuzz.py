"""Property-based fuzzing of the message decoders and of a live FFN rank's sockets.

Whatever arrives, the decoders either return a valid message or raise `ProtocolError`;
the FFN loop rejects and counts garbage, keeps serving valid peers, and does not
accumulate memory for it.
"""

import threading
import time

import msgpack
import pytest
import zmq
from hypothesis import example, given, settings
from hypothesis import strategies as st

from afd.config import AFDConfig
from afd.connector import wire
from afd.connector.tensors import from_frame
from afd.engine.generation import greedy_generate
from afd.local.children import free_port_block
from afd.roles.attention import build_attention
from afd.roles.ffn import build_ffn
from tests.conftest import NEW_TOKENS, PROMPTS

packable_ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
scalars = st.one_of(st.none(), st.booleans(), packable_ints, st.floats(allow_nan=False), st.text(max_size=20),
                    st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
message_like = st.fixed_dictionaries(
    {"v": st.one_of(st.just(wire.PROTOCOL_VERSION), packable_ints), "t": st.sampled_from(sorted(wire.MESSAGES) + ["x"])},
    optional={name: values for name in ("step_id", "stage_tokens", "seq", "reason", "rows", "cols", "dtype", "layers",
                                        "accepted", "attention_rank", "layer", "stage")},
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=256), message_like.map(lambda d: msgpack.packb(d, use_bin_type=True))))
def test_decode_returns_a_message_or_a_protocol_error(data):
    try:
        message = wire.decode(data)
    except wire.ProtocolError:
        return
    assert type(message) in wire.MESSAGES.values()
    assert wire.decode(wire.encode(message)) == message  # anything accepted is well-formed


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.integers(-4, 1 << 40), st.integers(-4, 1 << 40), st.sampled_from(["float32", "bfloat16", "int8", ""]))
@example(b"", 0, -3, "float32")  # negative sizes whose product matches the frame: rare draws, so named here
@example(bytes(16), -1, -4, "float32")
@example(bytes(4), -2, -2, "int8")
def test_tensor_frames_reject_every_size_mismatch(frame, rows, cols, dtype):
    try:
        tensor = from_frame(frame, rows, cols, dtype, "cpu")
    except wire.ProtocolError:  # the product's refusal; any other error (a raw torch one) fails the test
        return
    assert tuple(tensor.shape) == (rows, cols) and tensor.numel() * tensor.element_size() == len(frame)


@pytest.fixture(scope="module")
def live_ffn(checkpoints):
    port = free_port_block(2)
    config = AFDConfig(model=str(checkpoints["qwen3_moe"]), ffn_address_template="127.0.0.1", bind_host="127.0.0.1",
                       control_port=port, data_port=port + 1, peer_timeout_s=3.0, num_attention_ranks=2)
    runner = build_ffn(config.replace(role="ffn"))
    stop = threading.Event()
    thread = threading.Thread(target=runner.serve, args=(stop,), daemon=True)
    thread.start()
    context = zmq.Context()
    yield config, runner, context, thread
    stop.set()
    thread.join(5)
    context.destroy(linger=0)


def foreign_socket(context, port, identity):
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, identity)
    socket.setsockopt(zmq.LINGER, 2000)  # closing right after the send must still deliver it
    socket.connect(f"tcp://127.0.0.1:{port}")
    return socket


frames = st.lists(st.binary(max_size=128), min_size=1, max_size=4)


def test_garbage_is_rejected_counted_and_valid_peers_are_served_after_it(live_ffn, hf_reference):
    """Fuzzed frames from strangers on both sockets: the loop survives, counts them, keeps nothing
    for them, and then serves a real attention rank exactly."""
    config, runner, context, thread = live_ffn
    control_port, data_port = config.link.ffn_ports(0)

    @settings(max_examples=150, deadline=None)
    @given(control=frames, data=frames, identity=st.sampled_from([b"attn-0", b"attn-1", b"intruder", b"\x00\xff"]))
    def send_garbage(control, data, identity):
        for port, message in ((control_port, control), (data_port, data)):
            socket = foreign_socket(context, port, identity)
            socket.send_multipart(message)
            socket.close()

    send_garbage()
    time.sleep(0.5)  # let the loop drain what the fuzzer sent
    assert thread.is_alive()
    assert sum(runner.link.rejected.values()) > 0  # garbage was seen, counted, and survived
    assert len(runner.executor.plane._stash) == 0 and not runner.link.peers  # nothing kept for strangers
    role = build_attention(config.replace(role="attention", rank=0), 512)
    try:
        result = greedy_generate(role.runner, role.kv_cache, PROMPTS, NEW_TOKENS, ignore_eos=True)
    finally:
        role.close()
    assert result.tokens == hf_reference("qwen3_moe")[0]


def test_a_foreign_group_cannot_join(live_ffn):
    config, *_ = live_ffn
    from afd.connector.base import HandshakeError

    with pytest.raises(HandshakeError, match="group token differs"):
        build_attention(config.replace(role="attention", rank=1, group_token="other-group", group_secret="x"), 64)
