"""The unsplit model as a generation stepper: the reference the split path must equal."""

from __future__ import annotations

import torch

from afd.graphs.buckets import decode_buckets
from afd.graphs.decode import DecodeGraphs
from afd.graphs.mixed import MixedGraphs, token_buckets
from afd.kv.cache import KVCache
from afd.models.paged_attention import AttentionBatch
from afd.models.loader import LoadedModel
from afd.step.layout import SeqLayout
from afd.step.stages import StagePolicy


class MonolithicRunner:
    def __init__(self, loaded: LoadedModel, kv_cache: KVCache):
        self.model, self.kv_cache = loaded.model, kv_cache
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.logit_rows: torch.Tensor | None = None  # as `AttentionRunner.logit_rows` (prompt logprobs)
        self.row_logits: torch.Tensor | None = None

    @torch.inference_mode()
    def capture_graphs(self, max_batch: int, mixed_tokens: int = 0) -> DecodeGraphs:
        """Decode graphs over the same buckets as the attention role (the speed baseline), and piecewise
        graphs for steps with prompt tokens up to `mixed_tokens` (0: none), in the same memory pool."""
        body = lambda input_ids, micro: self.model(input_ids, micro[0][1], self.kv_cache)  # noqa: E731
        device = self.kv_cache.keys[0].device
        self.graphs = DecodeGraphs(body, self.kv_cache, decode_buckets(max_batch, 1), StagePolicy(), device)
        self.graphs.capture_all()
        if mixed_tokens:
            self.mixed_graphs = MixedGraphs(self.model, self.kv_cache, token_buckets(mixed_tokens), device,
                                            pool=self.graphs.pool)
            self.mixed_graphs.capture_all()
        return self.graphs

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        rows = self.logit_rows
        if rows is None and self.graphs is not None and (logits := self.graphs.run(input_ids, layout)) is not None:
            return logits
        if rows is None and self.mixed_graphs is not None and (logits := self.mixed_graphs.run(input_ids, layout)) is not None:
            return logits
        batch = AttentionBatch.build(
            layout.block_tables, layout.context_lens, layout.new_lens, self.kv_cache.block_size, input_ids.device
        )
        if rows is None:
            return self.model(input_ids, batch, self.kv_cache)
        last = len(layout.new_lens)
        logits = self.model(input_ids, batch, self.kv_cache, torch.cat([batch.last_token, rows]))
        self.row_logits = logits[last:]
        return logits[:last]
