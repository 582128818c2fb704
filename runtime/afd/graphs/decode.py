"""Full-decode CUDA graphs over padded batch buckets, for the attention role and the monolith.

A graph runs `body(input_ids [B], micro)` where `micro` lists (stage, AttentionBatch,
rows) over static device buffers: token ids, positions, cache write rows, key counts
and block tables, all sized for the largest bucket and sliced per bucket. A step of b
sequences pads to bucket B; padding rows attend only to themselves and write their
keys into the KV cache's scratch block, so they touch no real sequence.

`before(stage_tokens, mode)` runs on the host ahead of each warm-up, capture and replay of
bucket B, with B's per-stage token counts (the attention role sends its step plan there;
nothing host-side is ever captured).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from afd.graphs.buckets import bucket_for, capture_order, is_decode
from afd.graphs.capture import make_pool
from afd.kv.cache import KVCache
from afd.models.paged_attention import AttentionBatch
from afd.step.layout import SeqLayout
from afd.step.stages import StagePolicy

log = logging.getLogger(__name__)
Body = Callable[[torch.Tensor, list], torch.Tensor]


class DecodeGraphs:
    """One captured decode step per bucket; `run` replays the right one or returns None."""

    def __init__(self, body: Body, kv_cache: KVCache, buckets: tuple[int, ...], policy: StagePolicy,
                 device: torch.device, before: Callable[[tuple[int, ...], str], None] | None = None):
        self.body, self.kv_cache, self.buckets = body, kv_cache, buckets
        self.policy = policy  # each bucket's micro-batches (one token per sequence: `StagePolicy.rows`)
        self.device, self.before = device, before or (lambda stage_tokens, mode: None)
        self.pool = make_pool(device)
        largest, width = max(buckets), kv_cache.num_blocks + 1
        self.meta = torch.zeros(3, largest, dtype=torch.long, device=device)  # ids, positions, write rows
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)  # [Bmax]
        self.tables = torch.full((largest, width), kv_cache.scratch_block, dtype=torch.int32, device=device)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    @property
    def memory_bytes(self) -> int:
        return self.pool.memory_bytes

    def capture_all(self) -> None:
        """Warm up, then capture every bucket, largest first; each capture is replayed once."""
        for size in capture_order(self.buckets):
            self._fill_padding(size)
            self.before(self._stage_tokens(size), "warmup")
            self.body(self.meta[0, :size], self._micro(size))
            self.before(self._stage_tokens(size), "capture")
            self.graphs[size] = self.pool.capture(lambda size=size: self._record(size))
            self.graphs[size].replay()  # the capture only recorded: this runs the step for real
        log.info("captured decode graphs for batch sizes %s (%.1f MiB)", list(self.buckets), self.memory_bytes / 2**20)

    def _record(self, size: int) -> None:
        self.outputs[size] = self.body(self.meta[0, :size], self._micro(size))

    def run(self, input_ids: torch.Tensor, layout: SeqLayout) -> torch.Tensor | None:
        """Logits [b, vocab] from a replayed graph, or None when no graph serves this step."""
        size = bucket_for(len(layout.new_lens), self.buckets) if is_decode(layout.new_lens) else None
        if size is None or size not in self.graphs:
            return None
        self._fill(input_ids, layout, size)
        self.before(self._stage_tokens(size), "replay")
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][: len(layout.new_lens)]

    def _stage_tokens(self, size: int) -> tuple[int, ...]:
        return self.policy.rows(size)

    def _micro(self, size: int) -> list:
        micro, start = [], 0
        for stage, rows in enumerate(self._stage_tokens(size)):
            if not rows:
                continue
            part = slice(start, start + rows)
            batch = AttentionBatch.for_decode(
                self.meta[1, part], self.meta[2, part], self.tables[part], self.seq_lens[part], self.kv_cache.block_size
            )
            micro.append((stage, batch, part))
            start += rows
        return micro

    def _fill_padding(self, size: int) -> None:
        self.meta[:, :size] = 0
        self.meta[2, :size] = self.kv_cache.scratch_block * self.kv_cache.block_size
        self.seq_lens[:size] = 1
        self.tables[:size, 0] = self.kv_cache.scratch_block

    def _fill(self, input_ids: torch.Tensor, layout: SeqLayout, size: int) -> None:
        count, block = len(layout.new_lens), self.kv_cache.block_size
        scratch = self.kv_cache.scratch_block
        width = max(len(t) for t in layout.block_tables)
        tables = torch.full((size, width), scratch, dtype=torch.int32)  # [B, w] host
        for row, table in enumerate(layout.block_tables):
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        positions = torch.tensor(layout.context_lens, dtype=torch.long)
        meta = torch.zeros(3, size, dtype=torch.long)  # [3, B] host
        meta[1, :count] = positions
        meta[2, :count] = tables[torch.arange(count), positions // block].long() * block + positions % block
        meta[2, count:] = scratch * block
        lens = torch.ones(size, dtype=torch.int32)
        lens[:count] = positions.to(torch.int32) + 1
        self.meta[1:, :size].copy_(meta[1:], non_blocking=True)
        self.meta[0, :count].copy_(input_ids[:count])
        self.meta[0, count:size] = 0
        self.seq_lens[:size].copy_(lens, non_blocking=True)
        self.tables[:size, :width].copy_(tables, non_blocking=True)
