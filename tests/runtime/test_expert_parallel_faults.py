"""Expert-parallel FFN ranks under faults: a mis-sharded peer is refused, a killed shard fails the step
explicitly, and the group recovers once the shard is back."""

import dataclasses
import signal
import threading
import time

import pytest

from afd.config import AFDConfig, config_to_env
from afd.connector.base import HandshakeError
from afd.connector.hello_check import check_hello
from afd.runners.handshake import make_hello
from afd.models.spec import parse_spec
from afd.models.checkpoint import Checkpoint


def _hellos(path, shards=4, attention_shard=2, ffn_shard=1):
    config = AFDConfig(model=str(path), ffn_expert_parallel=shards, ffn_address_template="ffn-{rank}")
    spec = parse_spec(Checkpoint(path).config)
    attention = dataclasses.replace(make_hello(config.group, config.split, config.link, spec, (0, 1), "f", "float32"),
                                    ffn_shard=attention_shard)
    ffn_config = config.replace(role="ffn", ffn_shard=ffn_shard)
    ffn = make_hello(ffn_config.group, ffn_config.split, ffn_config.link, spec, (0, 1), "f", "float32")
    return attention, ffn


def test_check_hello_refuses_a_mis_sharded_peer(checkpoints):
    attention, ffn = _hellos(checkpoints["qwen3_moe"])
    reason = check_hello(attention, ffn, (0,))
    assert reason.startswith("mis-sharded peer: attention expects shard 2 of 4, this ffn process is shard 1 of 4")
    other_g = dataclasses.replace(attention, expert_parallel=2, ffn_shard=1)
    assert "shard 1 of 2" in check_hello(other_g, ffn, (0,))
    assert check_hello(dataclasses.replace(attention, ffn_shard=1), ffn, (0,)) is None


def test_a_shard_at_the_wrong_address_is_refused_in_the_handshake(checkpoints):
    """An FFN process that is shard 1 of 4 but reachable where shard 2 should be (a wrong ordinal)."""
    from afd.connector.attention_link import AttentionLink, LinkOptions
    from afd.roles.ffn import build_ffn
    from afd.roles.share import load_share
    from afd.runners.device import resolve_device, resolve_dtype

    base = AFDConfig(connector="loopback", model=str(checkpoints["qwen3_moe"]), ffn_expert_parallel=4,
                     ffn_address_template="mis-sharded", control_port=30000, data_port=30001, port_stride=10)
    # shard 1 with its ports moved by one stride listens where attention looks for shard 2
    ffn = build_ffn(base.replace(role="ffn", ffn_shard=1, control_port=30010, data_port=30011))
    stop = threading.Event()
    thread = threading.Thread(target=ffn.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        device = resolve_device(base.load)
        share = load_share(base.group, base.split, base.load.model, device, resolve_dtype(base.load, device))
        hello = dataclasses.replace(share.hello(base.group, base.split, base.link), ffn_shard=2)
        with pytest.raises(HandshakeError, match="mis-sharded peer: attention expects shard 2 of 4, this ffn process "
                                                 "is shard 1 of 4"):
            AttentionLink.connect(base.group, base.link, hello, "cpu", LinkOptions(connect_timeout_s=10), shard=2)
    finally:
        stop.set()
        thread.join(5)


def test_a_killed_shard_fails_the_step_and_the_group_recovers(checkpoints):
    from afd.engine.offline import generate_with_engine
    from afd.local.children import LocalProcesses, free_port_block, threads_per_rank
    from afd.local.group_processes import local_zmq_config
    from afd.roles.attention import build_attention
    from tests.conftest import PROMPTS

    config = local_zmq_config(AFDConfig(model=str(checkpoints["deepseek_v2"]), ffn_expert_parallel=2, port_stride=2,
                                        peer_timeout_s=8.0, connect_timeout_s=60.0))  # CI's 2 shared cores: slow, not lost
    threads = threads_per_rank(3)
    metrics_ports = free_port_block(2)

    def generate(role):
        return generate_with_engine(role.runner, role.kv_cache, PROMPTS[:2], 6, (), True).tokens

    with LocalProcesses() as processes:
        def start_shard(shard):
            env = {**config_to_env(config.replace(role="ffn", ffn_shard=shard, http_host="127.0.0.1",
                                                  metrics_port=metrics_ports + shard)), **threads}
            processes.start(f"ffn-0-shard-{shard}", ["serve"], env)

        start_shard(0)
        start_shard(1)
        role = build_attention(config, 1024)
        try:
            before = generate(role)  # first steps of fresh shards (runners/step_order.py: no race with shard 1's hello)
            processes.children["ffn-0-shard-1"].send_signal(signal.SIGKILL)
            processes.children["ffn-0-shard-1"].wait(5)
            started = time.monotonic()
            with pytest.raises(RuntimeError, match="shard 1 of 2"):
                generate(role)
            assert time.monotonic() - started < 20  # explicit (after the 8 s peer timeout), not a hang

            start_shard(1)
            deadline, recovered = time.monotonic() + 60, False
            while not recovered and time.monotonic() < deadline:
                try:
                    role.link.recover()
                    recovered = True
                except HandshakeError:
                    time.sleep(0.5)
            assert recovered
            assert generate(role) == before
        finally:
            role.close()

