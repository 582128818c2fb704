"""The start-up step ceiling and the KV-cache budget (the CPU side; tests/gpu covers sizing from the GPU)."""

import torch
from prometheus_client import CollectorRegistry, generate_latest

from afd.config import AFDConfig
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.roles.kv_sizing import serving_cache_tokens
from afd.roles.monolithic import build_monolithic
from afd.server.serve.ceiling import export_ceiling, step_seconds


def test_ceiling_is_timed_per_batch_exported_and_gives_its_blocks_back(checkpoints):
    config = AFDConfig(role="monolithic", model=str(checkpoints["qwen3_moe"]), device="cpu", ceiling_batches="1,2,4096")
    role = build_monolithic(config, 4096)
    registry = CollectorRegistry()
    results = export_ceiling(registry, config, role)
    assert sorted(results) == [1, 2] and all(0 < s < 10 for s in results.values())  # 4096 > max_num_seqs: skipped
    assert role.kv_cache.free_blocks == role.kv_cache.num_blocks
    assert 'afd_step_ceiling_seconds{batch="2",rank="0",role="monolithic"}' in generate_latest(registry).decode()


def test_kv_cache_bytes_overrides_and_cpu_defaults_to_one_gib(checkpoints):
    config = AFDConfig(model=str(checkpoints["qwen3_moe"]), device="cpu")
    loaded, cpu = load_model(config.model, "attention"), torch.device("cpu")
    per_token = KVCache.bytes_per_token(loaded.model.kv_layouts(), torch.float32)
    assert serving_cache_tokens(config, loaded, cpu, torch.float32) == (1 << 30) // per_token
    assert serving_cache_tokens(config.replace(kv_cache_bytes=per_token * 100), loaded, cpu, torch.float32) == 100


def test_ceiling_steps_differ_row_by_row_over_a_cache_of_noise(checkpoints):
    """A batch of one repeated token on an empty cache routes every row to the same experts: a flattering ceiling."""
    config = AFDConfig(role="monolithic", model=str(checkpoints["qwen3_moe"]), device="cpu")
    role = build_monolithic(config, 4096)
    seen = []

    def step(input_ids, layout):
        seen.append(input_ids.clone())
        first_block = layout.block_tables[0][0] * role.kv_cache.block_size
        seen.append(role.kv_cache.keys[0][first_block: first_block + role.kv_cache.block_size].abs().sum())
        return role.runner(input_ids, layout)

    step_seconds(step, role.kv_cache, 8, context=40, steps=2, vocab_size=role.loaded.spec.vocab_size)
    ids, cached = seen[0], seen[1]
    assert len(set(ids.tolist())) > 4 and int(ids.max()) < role.loaded.spec.vocab_size
    assert float(cached) > 0  # the context the step attends to is not all zeros
    assert role.kv_cache.free_blocks == role.kv_cache.num_blocks
