"""Assemble a role from its config: load its share of the model, open its connector.

`build_ffn` gives a ready FFN daemon; `build_attention` gives a connected, handshaken
attention rank with its KV cache. Both read the whole configuration from `AFDConfig`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from afd.config import AFDConfig
from afd.connector.attention_side import AttentionConnector
from afd.connector.factory import make_attention_connector, make_ffn_connector
from afd.connector.ffn_side import DataContract
from afd.kv_cache import KVCache
from afd.models.loader import LoadedModel, load_model
from afd.runners.attention_runner import AttentionRunner
from afd.runners.device import resolve_device, resolve_dtype, torch_dtype
from afd.runners.ffn_runner import FFNRunner
from afd.runners.handshake import make_hello

log = logging.getLogger(__name__)


def build_ffn(config: AFDConfig) -> FFNRunner:
    """FFN rank `config.rank`: FFN weights only, listening for its attention peers."""
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    loaded = load_model(config.model, "ffn", config.gate_on_attention, torch_dtype(dtype), device)
    expected = make_hello(config, loaded.spec, loaded.crossing, loaded.fingerprint, dtype)
    contract = DataContract(loaded.spec.hidden_size, dtype, expected.router_width)
    connector = make_ffn_connector(config, device, contract)
    served = config.topology.attention_ranks_of(config.rank)
    log.info("ffn rank %d serves attention ranks %s on layers %s", config.rank, list(served), list(loaded.crossing))
    return FFNRunner(loaded, connector, expected, served, config.rank)


@dataclass
class AttentionRole:
    """A connected attention rank: model share, KV cache, runner and its connector."""

    loaded: LoadedModel
    kv_cache: KVCache
    connector: AttentionConnector
    runner: AttentionRunner
    device: torch.device

    def close(self, reason: str = "shutdown") -> None:
        self.connector.close(reason)


def build_attention(config: AFDConfig, cache_tokens: int) -> AttentionRole:
    """Attention rank `config.rank`: its weights, a KV cache of `cache_tokens`, a handshaken FFN link."""
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    loaded = load_model(config.model, "attention", config.gate_on_attention, torch_dtype(dtype), device)
    kv_cache = KVCache.for_tokens(loaded.model.kv_layouts(), cache_tokens, torch_dtype(dtype), device)
    connector = make_attention_connector(config, device)
    try:
        connector.handshake(make_hello(config, loaded.spec, loaded.crossing, loaded.fingerprint, dtype), config.connect_timeout_s)
    except Exception:
        connector.transport.close()
        raise
    runner = AttentionRunner(loaded, connector, kv_cache, config.stages, config.gate_on_attention)
    return AttentionRole(loaded, kv_cache, connector, runner, device)
