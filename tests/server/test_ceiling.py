"""The start-up step ceiling and the KV-cache budget (the CPU side; tests/gpu covers sizing from the GPU)."""

import torch
from prometheus_client import CollectorRegistry, generate_latest

from afd.config import AFDConfig
from afd.kv_cache import KVCache
from afd.models.checkpoint import Checkpoint
from afd.models.spec import parse_spec
from afd.monolithic import build_monolithic
from afd.server.ceiling import export_ceiling
from afd.server.run import cache_tokens_for


def test_ceiling_is_timed_per_batch_exported_and_gives_its_blocks_back(checkpoints):
    config = AFDConfig(role="monolithic", model=str(checkpoints["qwen3_moe"]), device="cpu", ceiling_batches="1,2,4096")
    role = build_monolithic(config, 4096)
    registry = CollectorRegistry()
    results = export_ceiling(registry, config, role)
    assert sorted(results) == [1, 2] and all(0 < s < 10 for s in results.values())  # 4096 > max_num_seqs: skipped
    assert role.kv_cache.free_blocks == role.kv_cache.num_blocks
    assert 'afd_step_ceiling_seconds{batch="2",rank="0",role="monolithic"}' in generate_latest(registry).decode()


def test_kv_cache_bytes_overrides_and_cpu_defaults_to_one_gib(checkpoints):
    spec = parse_spec(Checkpoint(checkpoints["qwen3_moe"]).config)
    per_token = KVCache.bytes_per_token([spec.kv_layout] * spec.num_layers, torch.float32)
    config = AFDConfig(model=str(checkpoints["qwen3_moe"]), device="cpu")
    assert cache_tokens_for(config, spec) == (1 << 30) // per_token
    assert cache_tokens_for(config.replace(kv_cache_bytes=per_token * 100), spec) == 100
