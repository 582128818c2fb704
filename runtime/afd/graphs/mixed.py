"""Piecewise graphs for steps that carry prompt tokens (prefill and mixed steps).

A decode graph cannot serve a step whose sequences add several tokens: its attention
depends on every sequence's prompt length. Eagerly, such a step launches a few thousand
kernels one by one (about 2 ms of host time per layer at DeepSeek-V2-Lite shapes, whatever the
token count), so the host, not the GPU, sets its pace. Here, as vLLM's piecewise graphs do,
everything between two attention kernels is one captured segment shaped by the padded token
count alone: segment 0 embeds and projects layer 0's queries and keys; segment i finishes layer
i-1 (o_proj, residual, FFN) and projects layer i's; the last finishes the last layer. Only the
attention itself (cache write and kernel, reading the step's metadata) runs eagerly between them.

The FFN of a layer is a callable: the local one on the monolith; on an attention rank, the
exchange with the FFN rank (send, then receive its output: NCCL transfers are captured as the
decode graphs capture them). `before(stage_tokens, mode)` runs ahead of each warm-up, capture and
replay with the padded token count (the attention rank sends its step plan there, so the FFN rank
runs, captures or replays its own whole-step graph of that many rows).

A step of T tokens pads to the smallest token bucket >= T; padding rows run the segments on
token 0 at position 0 and are never attended, cached or read.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from afd.graphs.buckets import bucket_for, capture_order
from afd.graphs.capture import make_pool
from afd.kv.cache import KVCache
from afd.models.paged_attention import AttentionBatch
from afd.models.decoder import MoECausalLM
from afd.step.layout import SeqLayout

log = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Padded token counts to capture, ascending, the last one >= `max_tokens`: doubling from 16 to 256,
    then every 256 to 1024, then every 512 (a step pads by at most half itself, and by 512 rows past 1024)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: must be at least 1")
    sizes = [16, 32, 64, 128, 256, 512, 768, 1024] + list(range(1536, max_tokens + 512, 512))
    cut = next(i for i, size in enumerate(sizes) if size >= max_tokens)
    return tuple(sizes[: cut + 1])


LayerFFN = Callable[[int, torch.Tensor], torch.Tensor]  # (layer index, residual stream) → stream after its FFN


class MixedGraphs:
    """Per token bucket, one captured segment per gap between attention kernels; `run` replays them."""

    def __init__(self, model: MoECausalLM, kv_cache: KVCache, buckets: Sequence[int], device: torch.device, pool=None,
                 ffn: LayerFFN | None = None, before: Callable[[tuple[int, ...], str], None] | None = None,
                 stages: int = 1):
        self.model, self.kv_cache, self.buckets = model, kv_cache, tuple(sorted(buckets))
        self.pool = pool if pool is not None else make_pool(device)
        self.ffn = ffn or (lambda index, h: h + model.layers[index].ffn_half(h))
        self.before = before or (lambda stage_tokens, mode: None)
        self.stages = stages  # the plan names every stage; the piecewise step is one micro-batch
        largest = max(self.buckets)
        self.ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.hidden = torch.zeros(largest, model.spec.hidden_size, dtype=model.model.embed_tokens.weight.dtype,
                                  device=device)  # the model's dtype (the cache's may be FP8)
        with torch.inference_mode():  # the shapes of one token's attention inputs and output
            probe = model.layers[0].attention_inputs(self.hidden[:1], self.positions[:1])
        self.inputs = [None if t is None else torch.zeros((largest, *t.shape[1:]), dtype=t.dtype, device=device)
                       for t in probe]
        attention = model.layers[0].self_attn
        self.attended = torch.zeros(largest, attention.heads, attention.out_head_dim, dtype=self.hidden.dtype,
                                    device=device)
        self.segments: dict[int, list] = {}
        self.replays = 0

    @property
    def memory_bytes(self) -> int:
        return self.pool.memory_bytes

    def capture_all(self) -> None:
        """Warm up, then capture every bucket's segments, largest bucket first; each capture is replayed once
        (capturing only records: an FFN rank's transfers happen in the replay)."""
        before = self.memory_bytes
        for size in capture_order(self.buckets):
            count = len(self.model.layers) + 1
            self.before(self._stage_tokens(size), "warmup")
            for index in range(count):
                self._segment(index, size)  # warm-up: Triton compiles, the allocator settles
            self.before(self._stage_tokens(size), "capture")
            self.segments[size] = [self.pool.capture(lambda i=index, s=size: self._segment(i, s)) for index in range(count)]
            for segment in self.segments[size]:
                segment.replay()
        log.info("captured piecewise prefill graphs for %s tokens (%.1f MiB)", list(self.buckets),
                 (self.memory_bytes - before) / 2**20)

    def _stage_tokens(self, size: int) -> tuple[int, ...]:
        return (size,) + (0,) * (self.stages - 1)

    def _segment(self, index: int, size: int) -> None:
        """Finish layer index-1 (or embed when index is 0), then project layer index's attention inputs."""
        layers = self.model.layers
        if index == 0:
            h = self.model.embed(self.ids[:size])
        else:
            h = layers[index - 1].attention_output(self.hidden[:size], self.attended[:size])
            h = self.ffn(index - 1, h)
        self.hidden[:size].copy_(h)
        if index < len(layers):
            for buffer, value in zip(self.inputs, layers[index].attention_inputs(h, self.positions[:size])):
                if buffer is not None:
                    buffer[:size].copy_(value)

    def run(self, input_ids: torch.Tensor, layout: SeqLayout) -> torch.Tensor | None:
        """Logits [sequences, vocab] of each sequence's last new token, or None past the largest bucket."""
        tokens = layout.num_tokens
        size = bucket_for(tokens, self.buckets)
        if size is None or size not in self.segments:
            return None
        batch = AttentionBatch.build(layout.block_tables, layout.context_lens, layout.new_lens,
                                     self.kv_cache.block_size, self.ids.device)
        self.ids[:tokens].copy_(input_ids[:tokens])
        self.ids[tokens:size].zero_()
        self.positions[:tokens].copy_(batch.positions)
        self.positions[tokens:size].zero_()
        segments = self.segments[size]
        self.before(self._stage_tokens(size), "replay")
        segments[0].replay()
        for index, layer in enumerate(self.model.layers):
            inputs = tuple(None if t is None else t[:tokens] for t in self.inputs)
            self.attended[:tokens].copy_(layer.attend(inputs, batch, self.kv_cache.layer(index)))
            segments[index + 1].replay()
        self.replays += 1
        return self.model.compute_logits(self.hidden[:tokens][batch.last_token])
