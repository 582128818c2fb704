"""Peer identities on the FFN's sockets (issue 21 item 7) and Hellos queued while the FFN was down (issue 22 item 3)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import zmq

from afd.config import AFDConfig
from afd.connector import attention_link, wire
from afd.connector.attention_link import AttentionLink
from afd.connector.base import AttnTransfer
from afd.connector.identity import check_identity, identity_key, new_identity, show
from afd.engine.generation import greedy_generate
from afd.models.loader import load_model
from afd.local.children import free_port_block
from afd.roles.attention import build_attention
from afd.roles.ffn import build_ffn
from afd.runners.handshake import make_hello
from tests.conftest import NEW_TOKENS, PROMPTS

SECRET = "group-secret"


def test_identities_are_fresh_per_connection_and_need_the_secret():
    key = identity_key("token", SECRET)
    first, second = new_identity(0, key), new_identity(0, key)
    assert first != second and check_identity(first, 0, key) is None
    assert "another attention rank" in check_identity(first, 1, key)
    assert "secret" in check_identity(new_identity(0, identity_key("token", "guess")), 0, key)
    assert "not a connection identity" in check_identity(b"attn-0", 0, key)
    assert show(b"attn-0\x00\xff") == "attn-0\\x00\\xff"  # logged escaped, never a raw NUL
    assert show(first).startswith("attn-0#")


@pytest.fixture
def zmq_config(checkpoints):
    port = free_port_block(2)
    return AFDConfig(
        connector="zmq", model=str(checkpoints["qwen3_moe"]), ffn_address_template="127.0.0.1", bind_host="127.0.0.1",
        control_port=port, data_port=port + 1, group_secret=SECRET, peer_timeout_s=3.0, connect_timeout_s=20.0,
    )


def serve_ffn(config: AFDConfig):
    runner = build_ffn(config.replace(role="ffn"))
    stop = threading.Event()
    thread = threading.Thread(target=runner.serve, args=(stop,), daemon=True)
    thread.start()
    return runner, stop, thread


class Intruder(threading.Thread):
    """Connects again and again with guessed, stolen and forged identities; keeps what it receives."""

    def __init__(self, config: AFDConfig, hello: wire.Hello, real_identity: bytes):
        super().__init__(daemon=True)
        self.config, self.hello, self.stop = config, hello, threading.Event()
        forged = new_identity(0, identity_key(config.group_token, "a guess"))
        self.identities = [b"attn-0", b"attn-0\x00\x01", real_identity, forged]
        self.received: list[tuple[bytes, list[bytes]]] = []

    def run(self) -> None:
        context = zmq.Context()
        plan, data = wire.encode(wire.StepPlan(1, (2,))), wire.encode(wire.DataHeader(1, 0, 0, 2, 8, "float32"))
        while not self.stop.is_set():
            for identity in self.identities:
                sockets = []
                for port in (self.config.control_port, self.config.data_port):
                    socket = context.socket(zmq.DEALER)
                    socket.setsockopt(zmq.IDENTITY, identity)
                    socket.setsockopt(zmq.LINGER, 0)
                    socket.connect(f"tcp://127.0.0.1:{port}")
                    sockets.append(socket)
                sockets[0].send_multipart([wire.encode(self.hello)])
                sockets[0].send_multipart([plan])
                sockets[1].send_multipart([data, b"\0" * 64])
                deadline = time.monotonic() + 0.2
                while time.monotonic() < deadline:
                    for socket in sockets:
                        if socket.poll(10):
                            self.received.append((identity, socket.recv_multipart()))
                for socket in sockets:
                    socket.close(linger=0)
        context.term()

    def accepted(self) -> list:
        """What reached the intruder beyond a refusal or a Goodbye: must stay empty."""
        bad = []
        for identity, frames in self.received:
            try:
                message = wire.decode(frames[0])
            except wire.ProtocolError:
                bad.append((identity, "undecodable"))
                continue
            refused = isinstance(message, wire.HelloReply) and not message.accepted
            if not (refused or isinstance(message, (wire.Goodbye, wire.Heartbeat))):
                bad.append((identity, message))
        return bad


@pytest.mark.timeout(180)
def test_a_route_takeover_attempt_leaves_serving_untouched(zmq_config, caplog):
    """Guessed (`attn-0`), stolen (the live identity) and forged identities, with Hellos, plans and data:
    the real rank's output is unchanged, no step stalls, the intruder gets nothing meant for the rank."""
    runner, stop, thread = serve_ffn(zmq_config)
    role = build_attention(zmq_config, 4096)
    try:
        reference = greedy_generate(role.runner, role.kv_cache, PROMPTS, NEW_TOKENS, ignore_eos=True).tokens
        forged_hello = make_hello(zmq_config.replace(group_secret="a guess"), role.loaded.spec, role.loaded.crossing,
                                  role.loaded.fingerprint, "float32")
        intruder = Intruder(zmq_config, forged_hello, role.link.identity)
        step_times = []

        def timed_step(input_ids, layout):
            started = time.monotonic()
            logits = role.runner(input_ids, layout)
            step_times.append(time.monotonic() - started)
            role.link.keepalive()  # heartbeats answered all along: the control plane does not stall either
            return logits

        with caplog.at_level(logging.INFO):
            intruder.start()
            time.sleep(0.5)
            attacked = [greedy_generate(timed_step, role.kv_cache, PROMPTS, NEW_TOKENS, ignore_eos=True).tokens for _ in range(3)]
            intruder.stop.set()
            intruder.join(5)
        assert attacked == [reference] * 3
        assert max(step_times) < 1.0, f"a step stalled {max(step_times):.2f} s"  # the takeover stalled 5.5 s before
        assert intruder.received and intruder.accepted() == []
        assert list(runner.link.peers) == [role.link.identity]
        assert runner.link.handshake_failures > 0
        assert "\x00" not in caplog.text and "attn-0\\x00\\x01" in caplog.text
        assert "does not carry this group's secret" in caplog.text or "group token differs" in caplog.text
    finally:
        role.close()
        stop.set()
        thread.join(5)


@pytest.mark.timeout(120)
def test_hellos_queued_while_the_ffn_was_down_make_one_connection(zmq_config, monkeypatch, caplog):
    """The attention rank starts first and repeats its Hello; when the FFN comes up every queued
    Hello arrives at once: one connection, one log line, the same reply to each repeat."""
    monkeypatch.setattr(attention_link, "_HELLO_RETRY_S", 0.05)
    config = zmq_config.replace(role="attention")
    loaded = load_model(config.model, "attention")
    link = AttentionLink.open(config, "cpu")
    hello = make_hello(config, loaded.spec, loaded.crossing, loaded.fingerprint, "float32")
    replies = []
    handshake = threading.Thread(target=lambda: replies.append(link.handshake(hello, 20)), daemon=True)
    handshake.start()
    time.sleep(1.0)  # ~20 Hellos wait in the socket for an FFN that is not there yet
    with caplog.at_level(logging.INFO, logger="afd.connector.ffn_link"):
        runner, stop, thread = serve_ffn(zmq_config)
        try:
            handshake.join(20)
            assert replies and replies[0].accepted
            link.send_plan(wire.StepPlan(1, (3,)))
            transfer = AttnTransfer(1, loaded.crossing[0], 0)
            link.send(torch.randn(3, loaded.spec.hidden_size), transfer)
            assert link.recv(transfer).shape == (3, loaded.spec.hidden_size)
            time.sleep(0.5)  # every queued Hello has been answered by now
            connected = [r for r in caplog.records if "attention rank 0 connected" in r.getMessage()]
            assert len(connected) == 1, [r.getMessage() for r in connected]
            assert list(runner.link.peers) == [link.identity] and runner.link.handshake_failures == 0
        finally:
            link.close()
            stop.set()
            thread.join(5)


def test_a_retired_identity_is_refused_and_a_new_connection_replaces_the_old(checkpoints, caplog):
    config = AFDConfig(connector="loopback", model=str(checkpoints["qwen3_moe"]), ffn_address_template="identity-test",
                       group_secret=SECRET)
    runner = build_ffn(config.replace(role="ffn"))
    key = identity_key(config.group_token, SECRET)
    loaded = load_model(config.model, "attention")
    hello = make_hello(config.replace(role="attention"), loaded.spec, loaded.crossing, loaded.fingerprint, "float32")
    try:
        first, second = new_identity(0, key), new_identity(0, key)
        link = runner.link
        link.handle(first, hello)
        link.handle(first, hello)  # a repeat: answered again, not a second connection
        assert list(link.peers) == [first] and link.handshake_failures == 0
        link.handle(second, hello)  # the rank restarted: its old connection goes
        assert list(link.peers) == [second]
        with caplog.at_level(logging.ERROR):
            link.handle(first, hello)  # a replay of the closed connection's Hello
        assert list(link.peers) == [second] and link.handshake_failures == 1
        assert "was closed before" in caplog.text
    finally:
        runner.link.close()


def test_a_transfer_that_fails_outright_drops_only_the_lost_peer(checkpoints):
    """NCCL's network transport may report a peer's exit as an error mid-step: the FFN drops the
    peers its data plane names and keeps serving the others (it used to leave its serve loop)."""
    from afd.connector.base import ConnectorError

    config = AFDConfig(num_attention_ranks=2, num_ffn_ranks=1, connector="loopback", model=str(checkpoints["qwen3_moe"]),
                       ffn_address_template="fail-step-test", role="ffn")
    runner = build_ffn(config)
    try:
        runner.link.peers.update({b"a0": 0, b"a1": 1})

        def broken(transfer, watch, stop):
            raise ConnectorError("ncclSend failed: remote process exited")

        plane = runner.executor.plane
        plane.recv = broken
        plane.fail_step = lambda peers, error, watch: {b"a1": f"its connection closed ({error})"}
        runner.run_step({b"a0": wire.StepPlan(1, (2,)), b"a1": wire.StepPlan(1, (2,))})
        assert runner.link.peers == {b"a0": 0} and runner.steps_run == 1
    finally:
        runner.link.close()
