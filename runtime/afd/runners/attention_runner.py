"""The attention role's forward pass: local attention, remote FFN, optional two-stage ping-pong.

Per step: send the step plan; embed; then for each layer and each micro-batch,
collect that micro-batch's FFN output of the previous crossing layer, run attention,
and ship the layer's FFN input. With two stages, attention computes micro-batch 1
while the FFN computes micro-batch 0, and the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.connector import wire
from afd.connector.attention_side import AttentionConnector
from afd.connector.base import AttnTransfer
from afd.kv_cache import KVCache
from afd.models.attention import AttentionBatch
from afd.models.loader import LoadedModel
from afd.runners.microbatch import SeqLayout, split_layout


@dataclass
class _MicroBatch:
    stage: int
    batch: AttentionBatch
    hidden: torch.Tensor  # [tokens, hidden] residual stream
    waiting: AttnTransfer | None = None


class AttentionRunner:
    """Runs one attention rank's share of every step; callable as a generation stepper."""

    def __init__(self, loaded: LoadedModel, connector: AttentionConnector, kv_cache: KVCache, stages: int, gate_on_attention: bool):
        self.model = loaded.model
        self.crossing = frozenset(loaded.crossing)
        self.connector = connector
        self.kv_cache = kv_cache
        self.stages = stages
        self.gate_on_attention = gate_on_attention
        self.step_id = 0

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        """Logits [sequences, vocab] of each sequence's last new token."""
        self.step_id += 1
        parts = split_layout(layout, self.stages)
        self.connector.send_plan(wire.StepPlan(self.step_id, tuple(p.num_tokens for p in parts)))
        micro, start = [], 0
        device = input_ids.device
        for stage, part in enumerate(parts):
            if part.num_tokens:
                ids = input_ids[start : start + part.num_tokens]
                batch = AttentionBatch.build(
                    part.block_tables, part.context_lens, part.new_lens, self.kv_cache.block_size, device
                )
                micro.append(_MicroBatch(stage, batch, self.model.embed(ids)))
            start += part.num_tokens
        for index, layer in enumerate(self.model.layers):
            for mb in micro:
                self._collect(mb)
                mb.hidden = layer.attention_half(mb.hidden, mb.batch, self.kv_cache.layer(index))
                if index in self.crossing:
                    mb.waiting = AttnTransfer(self.step_id, index, mb.stage)
                    if self.gate_on_attention:
                        normed, router_logits = layer.gate_half(mb.hidden)
                        self.connector.send_attn_output(normed, mb.waiting, router_logits)
                    else:
                        self.connector.send_attn_output(mb.hidden, mb.waiting)
                else:
                    mb.hidden = mb.hidden + layer.ffn_half(mb.hidden)
        for mb in micro:
            self._collect(mb)
        last = torch.cat([mb.hidden[mb.batch.last_token] for mb in micro])
        return self.model.compute_logits(last)

    def _collect(self, mb: _MicroBatch) -> None:
        if mb.waiting is not None:
            mb.hidden = mb.hidden + self.connector.recv_ffn_output(mb.waiting).to(mb.hidden.dtype)
            mb.waiting = None
