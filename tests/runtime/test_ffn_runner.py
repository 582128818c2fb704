"""The FFN daemon loop: handshake refusals, idle peers, bad data, shutdown while blocked."""

import dataclasses
import logging
import threading
import time

import msgpack
import pytest
import torch

from afd.config import AFDConfig
from afd.connector import wire
from afd.connector.base import AttnTransfer, HandshakeError, PeerLost
from afd.connector.attention_link import AttentionLink
from afd.engine.generation import greedy_generate
from afd.roles.attention import build_attention
from afd.roles.ffn import build_ffn
from afd.runners.handshake import make_hello
from afd.models.loader import load_model
from tests.conftest import NEW_TOKENS, PROMPTS

_counter = iter(range(10**6))


@pytest.fixture
def group(checkpoints):
    """A running loopback FFN rank for 2A1F and a function making attention-side configs."""
    base = AFDConfig(
        num_attention_ranks=2,
        num_ffn_ranks=1,
        connector="loopback",
        model=str(checkpoints["qwen3_moe"]),
        ffn_address_template=f"ffn-test-{next(_counter)}",
        peer_timeout_s=3.0,
        connect_timeout_s=5.0,
    )
    runner = build_ffn(base.replace(role="ffn"))
    stop = threading.Event()
    thread = threading.Thread(target=runner.serve, args=(stop,), daemon=True)
    thread.start()
    yield base, runner, stop, thread
    stop.set()
    thread.join(timeout=5)


def attention_hello(base, rank=0, **changes):
    config = base.replace(role="attention", rank=rank)
    loaded = load_model(config.model, "attention")
    hello = make_hello(config, loaded.spec, loaded.crossing, loaded.fingerprint, "float32")
    return config, dataclasses.replace(hello, **changes)


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"model_fingerprint": "0000"}, "model fingerprint differs"),
        ({"layers": (1, 2)}, "crossing layer list differs: attention has [1, 2], ffn has [0, 1, 2, 3]"),
        ({"stages": 2}, "stage count differs"),
        ({"topology": "4A2F"}, "topology differs"),
        ({"token_digest": "abc"}, "group token differs"),
        ({"dtype": "bfloat16"}, "dtype differs"),
    ],
)
def test_handshake_refuses_mismatches_on_both_sides(group, changes, reason, caplog):
    base, *_ = group
    config, hello = attention_hello(base, **changes)
    with caplog.at_level(logging.ERROR, logger="afd.connector.ffn_link"):
        with pytest.raises(HandshakeError, match="refused the connection: " + reason.replace("[", r"\[").replace("]", r"\]")):
            AttentionLink.connect(config, hello, "cpu")
    assert any(reason in record.getMessage() for record in caplog.records)


def test_handshake_refuses_a_rank_it_does_not_serve(checkpoints):
    base = AFDConfig(num_attention_ranks=2, num_ffn_ranks=2, connector="loopback", model=str(checkpoints["qwen3_moe"]),
                     ffn_address_template=f"ffn-serve-{next(_counter)}-{{rank}}")
    runner = build_ffn(base.replace(role="ffn", rank=0))
    stop = threading.Event()
    thread = threading.Thread(target=runner.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        config, hello = attention_hello(base, rank=0, attention_rank=1)
        with pytest.raises(HandshakeError, match="not served by this ffn rank"):
            AttentionLink.connect(config, hello, "cpu")
    finally:
        stop.set()
        thread.join(5)


def test_other_protocol_version_is_refused_with_a_reply(group):
    base, *_ = group
    config, _ = attention_hello(base)
    link = AttentionLink.open(config, "cpu")
    link.transport.send("control", [msgpack.packb({"v": 2, "t": "hello"})])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        received = link.transport.recv(0.5)
        if received:
            reply = wire.decode(received[1][0])
            assert isinstance(reply, wire.HelloReply) and not reply.accepted
            assert "protocol version 2 is not supported" in reply.reason
            return
    pytest.fail("no reply to a Hello of another protocol version")


def test_idle_attention_rank_does_not_stall_a_busy_one(group, hf_reference):
    base, runner, *_ = group
    idle = build_attention(base.replace(role="attention", rank=1), 256)  # connected, never steps
    busy = build_attention(base.replace(role="attention", rank=0), 512)
    started = time.monotonic()
    result = greedy_generate(busy.runner, busy.kv_cache, PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert time.monotonic() - started < base.peer_timeout_s  # never waited for the idle peer
    assert result.tokens == hf_reference("qwen3_moe")[0]
    assert runner.steps_run == NEW_TOKENS
    idle.close()
    busy.close()


def test_bad_data_drops_only_the_sender(group, hf_reference):
    base, runner, *_ = group
    good = build_attention(base.replace(role="attention", rank=0), 512)
    bad = build_attention(base.replace(role="attention", rank=1), 256)
    bad.link.send_plan(wire.StepPlan(1, (2,)))
    bad.link.send(torch.zeros(2, 7), AttnTransfer(1, 0, 0))  # wrong width
    with pytest.raises(PeerLost, match="invalid data message"):
        bad.link.recv(AttnTransfer(1, 0, 0))
    result = greedy_generate(good.runner, good.kv_cache, PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert result.tokens == hf_reference("qwen3_moe")[0]
    assert sum(runner.link.rejected.values()) == 1
    good.close()


def test_shutdown_while_blocked_on_a_receive_returns_quickly(group):
    base, runner, stop, thread = group
    role = build_attention(base.replace(role="attention", rank=0), 256)
    role.link.send_plan(wire.StepPlan(1, (3,)))  # promise rows that never come
    time.sleep(0.3)  # the FFN is now waiting for layer 0 rows
    started = time.monotonic()
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert time.monotonic() - started < 5
    with pytest.raises(PeerLost, match="shutting down"):
        role.link.recv(AttnTransfer(1, 0, 0))
    assert not [t for t in threading.enumerate() if t.name.startswith("ffn-")]


def test_plans_sent_ahead_each_run_one_step_in_order(checkpoints):
    """An attention rank may queue several plans before its rows (graph warm-up and capture do):
    every plan runs its own step, in order, one per peer per step; a dropped peer's plans go."""
    config = AFDConfig(num_attention_ranks=2, num_ffn_ranks=1, connector="loopback", model=str(checkpoints["qwen3_moe"]),
                       ffn_address_template=f"ffn-test-{next(_counter)}", role="ffn")
    runner = build_ffn(config)
    try:
        link = runner.link
        link.peers.update({b"attn-0": 0, b"attn-1": 1})
        for step, rows in ((1, 2), (2, 3), (3, 4)):
            link.handle(b"attn-0", wire.StepPlan(step, (rows,)))
        link.handle(b"attn-1", wire.StepPlan(7, (1,)))
        first = link.next_plans()
        assert {peer: plan.step_id for peer, plan in first.items()} == {b"attn-0": 1, b"attn-1": 7}
        assert [plan.step_id for plan in link.next_plans().values()] == [2]
        link.drop(b"attn-0", "test")
        assert link.next_plans() == {}
    finally:
        runner.link.close()


def test_liveness_fails_while_the_loop_is_stuck_and_recovers_after(group):
    """Issue 35: the FFN pod's liveness probe (/live) asks the worker whether its loop still comes
    round. Idle, it does (every poll); stuck in a step waiting for rows that never come, it does
    not, until the step gives up on the silent peer (its timeout) and the loop goes on."""
    base, runner, stop, thread = group
    time.sleep(0.5)
    assert runner.stalled(0.4) is None  # idle: the loop polls and comes round
    role = build_attention(base.replace(role="attention", rank=0), 256)
    role.link.send_plan(wire.StepPlan(1, (3,)))  # promise rows that never come
    time.sleep(1.5)
    assert "has not come round for" in (runner.stalled(1.0) or "")
    deadline = time.monotonic() + base.peer_timeout_s + 5
    while runner.stalled(1.0) is not None:  # the step drops the silent peer, the loop goes on
        assert time.monotonic() < deadline, "the ffn loop never came round after the peer timeout"
        time.sleep(0.1)
    assert thread.is_alive()
