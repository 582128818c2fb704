"""The control-plane protocol: small, frozen, versioned messages encoded with msgpack.

Nothing is pickled. Decoding checks the version, the type and every field's type, so
a garbage or foreign message becomes a `ProtocolError` naming the problem.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 1
MAX_CONTROL_BYTES = 64 * 1024


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text says why."""


class ProtocolVersionError(ProtocolError):
    def __init__(self, version: Any):
        super().__init__(f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})")
        self.version = version


@dataclass(frozen=True)
class Hello:
    """Attention → FFN: who I am and what I run; the FFN refuses any mismatch."""

    TYPE: ClassVar[str] = "hello"
    attention_rank: int
    topology: str
    model_fingerprint: str
    layers: tuple[int, ...]
    hidden_size: int
    dtype: str
    stages: int
    gate_on_attention: bool
    router_width: int
    token_digest: str = ""
    connector: str = ""  # data plane: both sides must speak the same one
    expert_parallel: int = 1  # shards of the FFN rank (AFD_FFN_EXPERT_PARALLEL)
    ffn_shard: int = 0  # the shard of it this connection is meant for


@dataclass(frozen=True)
class HelloReply:
    """FFN → attention: accepted, or refused with the reason."""

    TYPE: ClassVar[str] = "hello_reply"
    accepted: bool
    ffn_rank: int
    reason: str = ""
    nccl_id: str = ""  # hex NCCL unique id of the pair's communicator (nccl connector only)


@dataclass(frozen=True)
class StepPlan:
    """Attention → FFN once per step: every wire shape of the step follows from it."""

    TYPE: ClassVar[str] = "step_plan"
    step_id: int
    stage_tokens: tuple[int, ...]
    warmup: bool = False
    capture: bool = False
    replay: bool = False
    profile: bool = False


@dataclass(frozen=True)
class Heartbeat:
    TYPE: ClassVar[str] = "heartbeat"
    seq: int


@dataclass(frozen=True)
class Goodbye:
    TYPE: ClassVar[str] = "goodbye"
    reason: str = ""


@dataclass(frozen=True)
class Draining:
    """FFN → attention: this rank is about to stop (its pod is being deleted). The attention rank
    turns unready, so the Service stops sending it requests, and finishes those it runs; the FFN
    stops once they are done. An older attention rank ignores it (an unknown type is logged)."""

    TYPE: ClassVar[str] = "draining"
    reason: str = ""


@dataclass(frozen=True)
class DataHeader:
    """First frame of every data-plane message: which tensor follows and its shape."""

    TYPE: ClassVar[str] = "data"
    step_id: int
    layer: int
    stage: int
    rows: int
    cols: int
    dtype: str
    logit_cols: int = 0


@dataclass(frozen=True)
class ShardHello:
    """FFN shard s > 0 → shard 0 of its rank, repeated every second: send me your step orders."""

    TYPE: ClassVar[str] = "shard_hello"
    shard: int
    expert_parallel: int
    token_digest: str = ""


@dataclass(frozen=True)
class StepOrder:
    """Shard 0 → the other shards of its rank, once per step: which attention ranks' plans (by step id)
    the step runs. Every shard runs the same steps in the same order, so no attention rank waits on a
    shard that is busy with a step another shard has not started (afd.runners.step_order)."""

    TYPE: ClassVar[str] = "step_order"
    attention_ranks: tuple[int, ...]
    step_ids: tuple[int, ...]


MESSAGES = {cls.TYPE: cls for cls in (Hello, HelloReply, StepPlan, Heartbeat, Goodbye, Draining, DataHeader,
                                      ShardHello, StepOrder)}
_SCALARS = {"int": int, "str": str, "bool": bool}


def encode(message: Any) -> bytes:
    body = asdict(message)
    body.update(v=PROTOCOL_VERSION, t=message.TYPE)
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes, max_bytes: int = MAX_CONTROL_BYTES) -> Any:
    """Bytes → message, or `ProtocolError` saying what is wrong with them."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several types for malformed input
        raise ProtocolError(f"undecodable message ({type(err).__name__})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"expected a map, got {type(body).__name__}")
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolVersionError(body.get("v"))
    cls = MESSAGES.get(body.get("t"))
    if cls is None:
        raise ProtocolError(f"unknown message type {body.get('t')!r}")
    values = {key: value for key, value in body.items() if key not in ("v", "t")}
    expected = {f.name: f for f in fields(cls)}
    if unknown := set(values) - set(expected):
        raise ProtocolError(f"{cls.TYPE}: unknown fields {sorted(unknown)}")
    for name, spec in expected.items():
        if name in values:
            values[name] = _check_field(cls.TYPE, name, spec.type, values[name])
    try:
        return cls(**values)
    except TypeError as err:
        raise ProtocolError(f"{cls.TYPE}: {err}") from None


def _check_field(message: str, name: str, type_name: str, value: Any) -> Any:
    if type_name.startswith("tuple"):
        if not isinstance(value, list) or not all(type(v) is int for v in value):
            raise ProtocolError(f"{message}.{name}: expected a list of integers")
        return tuple(value)
    expected = _SCALARS[type_name]
    if type(value) is not expected:
        raise ProtocolError(f"{message}.{name}: expected {type_name}, got {type(value).__name__}")
    if expected is int and not -(2**62) < value < 2**62:
        raise ProtocolError(f"{message}.{name}: integer out of range")
    return value
