"""How many tokens a serving rank's KV cache holds (the attention and monolithic roles): `kv_cache_bytes` when set,
1 GiB on a CPU, and by default on a GPU what fits beside the loaded weights and the peak of the largest step."""

from __future__ import annotations

import logging

import torch

from afd.config import GraphSettings, KVCacheSettings, SchedulerSettings, SplitSettings
from afd.kv.budget import CudaMemory, DeviceMemory, graph_margin_bytes, plan_kv_budget, profile_peak
from afd.kv.cache import DEFAULT_BLOCK_SIZE, KVCache
from afd.models.kv_dtype import cache_dtype
from afd.models.loader import LoadedModel
from afd.models.spec import ModelSpec
from afd.runners.profile_step import run_largest_steps

log = logging.getLogger(__name__)
DEFAULT_KV_CACHE_BYTES = 1 << 30


def serving_cache_tokens(role: str, kv: KVCacheSettings, scheduler: SchedulerSettings, split: SplitSettings,
                         graphs: GraphSettings, loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> int:
    """KV-cache capacity in tokens of a `role` rank that has loaded its weights on `device`: from `kv_cache_bytes`
    when set (1 GiB on CPU when not); on a GPU, by default, sized from the device's free memory
    (`profiled_cache_tokens`)."""
    if kv.kv_cache_bytes or device.type != "cuda":
        return fixed_cache_tokens(kv, loaded.spec, dtype)
    return profiled_cache_tokens(role, kv, scheduler, split, graphs, loaded, CudaMemory(device), dtype, device)


def fixed_cache_tokens(kv: KVCacheSettings, spec: ModelSpec, dtype: torch.dtype) -> int:
    """The tokens `kv_cache_bytes` (1 GiB when unset) holds in a cache of `kv_cache_dtype` (a model of `dtype`)."""
    layouts = [spec.kv_layout] * spec.num_layers
    per_token = KVCache.bytes_per_token(layouts, cache_dtype(kv.kv_cache_dtype, dtype))
    return (kv.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // per_token


def profiled_cache_tokens(role: str, kv: KVCacheSettings, scheduler: SchedulerSettings, split: SplitSettings,
                          graphs: GraphSettings, loaded: LoadedModel, memory: DeviceMemory, dtype: torch.dtype,
                          device: torch.device) -> int:
    """KV-cache tokens that fit beside the weights and the peak of the largest step of a `role` rank (attention or
    monolithic), run now (`afd.kv.budget`), in a cache of `kv_cache_dtype` (a model of `dtype`)."""
    kv_dtype = cache_dtype(kv.kv_cache_dtype, dtype)
    try:
        max_len = scheduler.max_model_len_of(loaded.spec)
        peak = profile_peak(lambda: run_largest_steps(role, scheduler, split, loaded, kv_dtype, device, max_len), memory)
    except torch.cuda.OutOfMemoryError as err:
        raise RuntimeError(
            f"the largest step this rank can be given ({scheduler.max_num_batched_tokens} tokens over up to "
            f"{scheduler.max_num_seqs} sequences) does not fit in GPU memory beside the weights: lower "
            f"max_num_batched_tokens or max_num_seqs ({err})") from None
    per_token = KVCache.bytes_per_token(loaded.model.kv_layouts(), kv_dtype)
    if graphs.cuda_graphs:  # the decode graphs' block tables grow with the cache
        per_token += 4 * scheduler.max_num_seqs // DEFAULT_BLOCK_SIZE + 1
    mixed_tokens = graphs.piecewise_tokens(scheduler.max_num_batched_tokens)
    budget = plan_kv_budget(memory, kv.gpu_memory_utilization, peak, per_token, graph_margin_bytes(mixed_tokens))
    log.info("KV cache sized from the GPU (activation peak of a %d-token step): %s", scheduler.max_num_batched_tokens,
             budget.describe(per_token))
    if budget.held_bytes > 1 << 30:
        log.warning("the CUDA caching allocator holds %.1f GiB that no tensor uses (fragments left by loading): the KV "
                    "cache cannot take them", budget.held_bytes / 2**30)
    return budget.tokens
