"""Transports are asked what they can do (their registry entry), never by name."""

import dataclasses

import pytest
import torch

from afd.config import CONNECTORS, AFDConfig
from afd.connector import registry
from afd.models.checkpoint import Checkpoint
from afd.models.spec import parse_spec
from afd.roles.share import graphs_usable
from afd.runners.handshake import make_hello


def test_every_transport_lives_under_transports_and_says_what_it_can_do():
    for name in CONNECTORS:
        entry = registry.transport(name)
        assert type(entry).__module__ == "afd.connector.plane"
        assert entry.wire_name in ("host", "nccl") and isinstance(entry.graph_capturable, bool)
        assert entry.open_peer.__module__.startswith("afd.connector.transports.")
    assert registry.transport("zmq").wire_name == registry.transport("loopback").wire_name  # both send host frames


@pytest.fixture
def capturable_zmq(monkeypatch):
    """The zmq entry, but claiming graph capture and a wire name of its own: what a new transport would say."""
    real = registry.transport
    entry = dataclasses.replace(real("zmq"), wire_name="zmq-capturable", graph_capturable=True)
    monkeypatch.setattr(registry, "transport", lambda name: entry if name == "zmq" else real(name))
    return entry


def test_graphs_follow_what_the_transport_can_capture(capturable_zmq, monkeypatch):
    config = AFDConfig(connector="zmq", cuda_graphs=True)
    assert graphs_usable(config, torch.device("cuda"), "bfloat16")  # no name check left
    monkeypatch.undo()
    assert not graphs_usable(config, torch.device("cuda"), "bfloat16")  # host frames cannot be captured


def test_the_hello_names_the_transport_by_its_wire_name(capturable_zmq, checkpoints):
    spec = parse_spec(Checkpoint(checkpoints["qwen3_moe"]).config)
    hello = make_hello(AFDConfig(connector="zmq", role="attention"), spec, (0,), "f", "float32")
    assert hello.connector == "zmq-capturable"
