"""The unsplit model as a generation stepper: the reference the split path must equal."""

from __future__ import annotations

import torch

from afd.kv_cache import KVCache
from afd.models.attention import AttentionBatch
from afd.models.loader import LoadedModel
from afd.runners.microbatch import SeqLayout


class MonolithicRunner:
    def __init__(self, loaded: LoadedModel, kv_cache: KVCache):
        self.model, self.kv_cache = loaded.model, kv_cache

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        batch = AttentionBatch.build(
            layout.block_tables, layout.context_lens, layout.new_lens, self.kv_cache.block_size, input_ids.device
        )
        return self.model(input_ids, batch, self.kv_cache)
