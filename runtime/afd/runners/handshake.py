"""What a Hello says (built from a role's group, split and link settings); the FFN rank's check of one is `afd.connector.hello_check`."""

from __future__ import annotations

import hashlib

from afd.config import GroupSettings, LinkSettings, SplitSettings
from afd.connector import registry
from afd.connector.wire import Hello
from afd.models.spec import ModelSpec


def token_digest(token: str, secret: str = "") -> str:
    """The group token and secret never travel; their digest does (empty when neither is set)."""
    if not token and not secret:
        return ""
    return hashlib.sha256(f"{secret}\0{token}".encode()).hexdigest()[:32]


def make_hello(group: GroupSettings, split: SplitSettings, link: LinkSettings, spec: ModelSpec,
               crossing: tuple[int, ...], fingerprint: str, dtype: str) -> Hello:
    return Hello(
        attention_rank=group.rank if group.role == "attention" else -1,
        topology=str(group.topology),
        model_fingerprint=fingerprint,
        layers=tuple(crossing),
        hidden_size=spec.hidden_size,
        dtype=dtype,
        stages=split.stages,
        gate_on_attention=split.gate_on_attention,
        router_width=spec.num_experts if split.gate_on_attention else 0,
        token_digest=token_digest(group.group_token, group.group_secret),
        connector=registry.transport(link.connector).wire_name,
        expert_parallel=group.ffn_expert_parallel,
        ffn_shard=group.ffn_shard if group.role == "ffn" else 0,  # attention: set per shard link
    )
