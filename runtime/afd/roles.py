"""Assemble a role from its config: load its share of the model, open its connector.

`build_ffn` gives a ready FFN daemon; `build_attention` gives a connected, handshaken
attention rank with its KV cache. Both read the whole configuration from `AFDConfig`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from afd.config import AFDConfig
from afd.connector.attention_side import AttentionConnector
from afd.connector.factory import make_attention_connector, make_ffn_connector
from afd.connector.ffn_side import DataContract
from afd.connector.identity import identity_key
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
    if device.type == "cuda":
        from afd.kernels.moe import warm_up

        log.info("ffn rank %d: MoE kernels warmed up for %d token counts", config.rank, warm_up(loaded.model))
    expected = make_hello(config, loaded.spec, loaded.crossing, loaded.fingerprint, dtype)
    contract = DataContract(loaded.spec.hidden_size, dtype, expected.router_width)
    connector = make_ffn_connector(config, device, contract)
    served = config.topology.attention_ranks_of(config.rank)
    log.info("ffn rank %d serves attention ranks %s on layers %s", config.rank, list(served), list(loaded.crossing))
    runner = FFNRunner(loaded, connector, expected, served, config.rank, identity_key(config.group_token, config.group_secret))
    runner.batch_window_s = config.ffn_batch_window_s
    if graphs_usable(config, device, dtype):
        from afd.graphs.ffn import FFNGraphs

        runner.graphs = FFNGraphs(device)
    return runner


def graphs_usable(config: AFDConfig, device: torch.device, dtype: str) -> bool:
    """CUDA graphs need a GPU, the NCCL data plane (host transfers cannot be captured) and bf16/fp16."""
    if not config.cuda_graphs:
        return False
    problems = [
        why for bad, why in (
            (device.type != "cuda", "no CUDA device"),
            (config.connector != "nccl", f"connector={config.connector} moves tensors through the host"),
            (dtype == "float32", "float32 experts take the host-synchronising reference path"),
        ) if bad
    ]
    if problems:
        log.warning("cuda_graphs is on but disabled here: %s", "; ".join(problems))
    return not problems


@dataclass
class AttentionRole:
    """A connected attention rank: model share, KV cache, runner and its connector."""

    loaded: LoadedModel
    kv_cache: KVCache
    connector: AttentionConnector
    runner: AttentionRunner
    device: torch.device

    reconnect_timeout_s: float = 5.0
    recover_attempts: int = 0
    recover_failures: int = 0  # afd_peer_reconnect_failures_total
    graph_buckets: tuple[int, ...] | None = None  # decode graphs to capture again after a recovery

    def close(self, reason: str = "shutdown") -> None:
        if self.runner.graphs is not None:  # release graphs first, then the connector (docs/architecture.md)
            torch.cuda.synchronize(self.device)
            self.runner.graphs = None
        self.connector.close(reason)

    def keepalive(self) -> None:
        """Heartbeat the FFN rank between steps; raises `PeerLost` when it is gone."""
        self.connector.keepalive()

    def recover(self) -> None:
        """Re-handshake with a returned FFN rank on a new connection; the KV cache stays.

        With NCCL the lost pair is aborted and a new one built; the decode graphs replayed
        the old pair, so they are released and captured again, which also re-warms the
        FFN's graph cache (its plans drive the FFN's captures). Logged at INFO and counted.
        """
        self.recover_attempts += 1
        ffn_rank, started = self.connector.ffn_rank, time.monotonic()
        log.info("re-handshaking with ffn rank %d (attempt %d)", ffn_rank, self.recover_attempts)
        buckets = self.graph_buckets
        try:
            self.connector.abandon()  # stuck transfers end and the stream drains before the graphs go
            self.runner.graphs = None
            self.connector.reconnect(self.reconnect_timeout_s)
            if buckets is not None:
                self.runner.capture_graphs(max(buckets))
        except Exception as err:
            self.recover_failures += 1
            log.info("re-handshake with ffn rank %d failed (attempt %d, %d failed so far): %s",
                     ffn_rank, self.recover_attempts, self.recover_failures, err)
            raise
        log.info("ffn rank %d linked again in %.1f s%s", ffn_rank, time.monotonic() - started,
                 f" (decode graphs for {list(buckets)} captured again)" if buckets else "")


def build_attention(config: AFDConfig, cache_tokens) -> AttentionRole:
    """Attention rank `config.rank`: its weights, a KV cache of `cache_tokens` (an int, or a callable
    that sizes it from the loaded model and the free device memory), a handshaken FFN link."""
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    loaded = load_model(config.model, "attention", config.gate_on_attention, torch_dtype(dtype), device)
    tokens = cache_tokens(loaded) if callable(cache_tokens) else cache_tokens
    kv_cache = KVCache.for_tokens(loaded.model.kv_layouts(), tokens, torch_dtype(dtype), device)
    log.info("attention rank %d: KV cache of %d tokens (%d blocks of %d), %.2f GiB, %d bytes per token",
             config.rank, kv_cache.capacity_tokens, kv_cache.num_blocks, kv_cache.block_size, kv_cache.nbytes / 2**30,
             KVCache.bytes_per_token(kv_cache.layouts, torch_dtype(dtype)))
    connector = make_attention_connector(config, device)
    try:
        connector.handshake(make_hello(config, loaded.spec, loaded.crossing, loaded.fingerprint, dtype), config.connect_timeout_s)
    except Exception:
        connector.transport.close()
        raise
    runner = AttentionRunner(loaded, connector, kv_cache, config.stages, config.gate_on_attention)
    runner.dbo_min_tokens = config.dbo_min_tokens
    if graphs_usable(config, device, dtype):
        try:  # warm-up and capture drive the FFN through their plans; Ready only after this
            graphs = runner.capture_graphs(min(config.max_num_seqs, kv_cache.num_blocks))
        except Exception:
            connector.close("graph capture failed")
            raise
        log.info("attention rank %d: decode graphs for %s sequences, %.1f MiB",
                 config.rank, list(graphs.buckets), graphs.memory_bytes / 2**20)
    role = AttentionRole(loaded, kv_cache, connector, runner, device)
    role.graph_buckets = runner.graphs.buckets if runner.graphs is not None else None
    return role
