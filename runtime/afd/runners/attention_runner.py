"""The attention role's forward pass: local attention, remote FFN, optional two-stage ping-pong.

Per step: send the step plan; embed; then for each layer and each micro-batch,
collect that micro-batch's FFN output of the previous crossing layer, run attention,
and ship the layer's FFN input. With two stages, attention computes micro-batch 1
while the FFN computes micro-batch 0, and the other way round. A call returns once the
step is launched, not finished: whoever reads its results waits on the link first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from afd.config import SplitSettings
from afd.connector import wire
from afd.connector.attention_link import AttentionLink
from afd.connector.base import AttnTransfer
from afd.kv.cache import KVCache
from afd.models.paged_attention import AttentionBatch
from afd.models.loader import LoadedModel
from afd.graphs.buckets import decode_buckets
from afd.graphs.decode import DecodeGraphs
from afd.graphs.mixed import MixedGraphs, token_buckets
from afd.metrics.layer_clock import StepInstruments
from afd.step.layout import SeqLayout, split_layout
from afd.step.stages import StagePolicy


@dataclass(frozen=True)
class StepOptions:
    """How a step runs on attention: its stage policy and where the gate runs."""

    policy: StagePolicy = StagePolicy()
    gate_on_attention: bool = False

    @classmethod
    def of(cls, split: SplitSettings) -> "StepOptions":
        return cls(StagePolicy.of(split), split.gate_on_attention)


@dataclass
class _MicroBatch:
    stage: int
    batch: AttentionBatch
    hidden: torch.Tensor  # [tokens, hidden] residual stream
    waiting: AttnTransfer | None = None
    normed: torch.Tensor | None = None  # the next layer's input norm of `hidden`, when the collect computed it


class AttentionRunner:
    """Runs one attention rank's share of every step; callable as a generation stepper."""

    def __init__(self, loaded: LoadedModel, link: AttentionLink, kv_cache: KVCache, options: StepOptions,
                 instruments: StepInstruments = StepInstruments()):
        self.model = loaded.model
        self.crossing = frozenset(loaded.crossing)
        self.link = link
        self.kv_cache = kv_cache
        self.policy = options.policy
        self.stages = options.policy.stages
        self.gate_on_attention = gate_on_attention = options.gate_on_attention
        self.step_id = 0
        self.graphs: DecodeGraphs | None = None  # set by capture_graphs
        self.mixed_graphs: MixedGraphs | None = None  # piecewise graphs of prompt steps, set by capture_graphs
        self.eager_steps = 0  # steps no graph served while graphs were on
        self.profiled_eager_steps = 0  # of those, steps run eagerly because they were profiled
        self.clock = instruments.clock  # per-layer timings of sampled steps (afd.metrics.layer_clock)
        self.on_layers = instruments.on_layers  # receives (kind, layer, seconds) of each profiled step
        self.transfer_bytes = {"send": 0, "recv": 0}
        self.capture_seconds = 0.0  # wall time of the last warm-up and capture
        self.warming = False  # steps before serving (afd.runners.warm_steps): their plans say warm-up
        # Prompt logprobs: token rows of the next step whose logits are wanted too (set by the engine; the step then
        # runs eagerly), and those logits once it ran.
        self.logit_rows: torch.Tensor | None = None
        self.row_logits: torch.Tensor | None = None
        self._lost_buckets: tuple[int, ...] | None = None  # decode graphs to capture again once relinked
        self._lost_mixed_tokens = 0  # and the piecewise graphs' largest token count
        hidden = loaded.spec.hidden_size
        self._hidden_per_token = len(self.crossing) * hidden  # elements each way, per token and step
        self._logit_bytes_per_token = len(self.crossing) * 4 * loaded.spec.num_experts if gate_on_attention else 0
        self._shards = getattr(link, "shards", 1)  # an FFN rank of G expert shards: every row goes to each
        self._hidden_element = self.model.model.embed_tokens.weight.element_size()  # the model's dtype, not the cache's

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        """Logits [sequences, vocab] of each sequence's last new token, once the step is launched.

        The device may still be running it: `link.end_step()` marks it and `link.wait_step(mark)`
        waits (the engine does so before reading its tokens), so the host can prepare the next
        step meanwhile. The FFN runs each peer's plans in order, so the next plan may go first.
        A graph replay is launched behind the step in flight; an eager step waits for it first.
        """
        self._count_bytes(layout.num_tokens, self._hidden_element)
        profiling = self.clock.should_profile(self.step_id + 1)
        if self.graphs is not None:
            if not profiling and self.logit_rows is None:
                logits = self.graphs.run(input_ids, layout)
                if logits is None and self.mixed_graphs is not None:
                    logits = self.mixed_graphs.run(input_ids, layout)
                if logits is not None:
                    return logits
            self.eager_steps += 1
            self.profiled_eager_steps += profiling
        # An eager step's metadata goes to the device by copies that wait for the stream with no deadline:
        # the step in flight is waited for on the link first, where a lost FFN is noticed in time.
        self.link.wait_step()
        self.clock.begin(profiling)
        parts = split_layout(layout, self.policy)
        self._send_plan(tuple(p.num_tokens for p in parts), profile=profiling)
        micro, start = [], 0
        for stage, part in enumerate(parts):
            if part.num_tokens:
                batch = AttentionBatch.build(
                    part.block_tables, part.context_lens, part.new_lens, self.kv_cache.block_size, input_ids.device
                )
                micro.append((stage, batch, slice(start, start + part.num_tokens)))
            start += part.num_tokens
        logits = self.forward(input_ids, micro, self.logit_rows)
        if profiling:  # its layer timings are read once it has ended (a profiled step is eager anyway)
            self.link.wait_step()
            if self.on_layers is not None:
                self.on_layers(self.clock.collect())
        return logits

    def _count_bytes(self, tokens: int, element: int) -> None:
        """Bytes this step moves, from its token count (also right for replayed graphs): with G expert
        shards every row goes to each shard and each sends back a float32 partial sum."""
        sent = tokens * (self._hidden_per_token * element + self._logit_bytes_per_token)
        returned = tokens * self._hidden_per_token * (4 if self._shards > 1 else element)
        self.transfer_bytes["send"] += self._shards * sent
        self.transfer_bytes["recv"] += self._shards * returned

    def forward(self, input_ids: torch.Tensor, micro: list, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The step's tensor work for (stage, batch, rows) micro-batches; capturable in a graph. With `logit_rows`
        (token rows of the step) their logits are kept in `row_logits` as well."""
        micro = [_MicroBatch(stage, batch, self.model.embed(input_ids[rows])) for stage, batch, rows in micro]
        clock = self.clock
        for index, layer in enumerate(self.model.layers):
            for mb in micro:
                self._collect(mb, layer.input_layernorm)
                started = clock.now()
                mb.hidden = layer.attention_half(mb.hidden, mb.batch, self.kv_cache.layer(index), mb.normed)
                mb.normed = None
                if index in self.crossing:
                    mb.waiting = AttnTransfer(self.step_id, index, mb.stage)
                    self._ship(layer, mb.hidden, mb.waiting, started)
                else:
                    mb.hidden = mb.hidden + layer.ffn_half(mb.hidden)
                    clock.lap("compute", index, started)
        for mb in micro:
            self._collect(mb)
        last = torch.cat([mb.hidden[mb.batch.last_token] for mb in micro])
        if logit_rows is None:
            return self.model.compute_logits(last)
        every = torch.cat([mb.hidden for mb in micro])
        logits = self.model.compute_logits(torch.cat([last, every[logit_rows]]))
        self.row_logits = logits[len(last):]
        return logits[: len(last)]

    def _ship(self, layer, hidden: torch.Tensor, transfer: AttnTransfer, started: float) -> None:
        """Send layer `transfer.layer`'s FFN input: the residual stream, or with the gate here its norm and router logits."""
        clock = self.clock
        if self.gate_on_attention:
            normed, router_logits = layer.gate_half(hidden)
            clock.lap("compute", transfer.layer, started)
            sending = clock.now()
            self.link.send(normed, transfer, router_logits)
        else:
            clock.lap("compute", transfer.layer, started)
            sending = clock.now()
            self.link.send(hidden, transfer)
        clock.lap("send", transfer.layer, sending)

    def _exchange(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """The residual stream after layer `index`'s FFN, for a step of one micro-batch (the piecewise
        prompt steps): local FFN, or ship to the FFN rank and add what comes back."""
        layer = self.model.layers[index]
        if index not in self.crossing:
            return hidden + layer.ffn_half(hidden)
        transfer = AttnTransfer(self.step_id, index, 0)
        self._ship(layer, hidden, transfer, self.clock.now())
        return hidden + self.link.recv(transfer).to(hidden.dtype)

    def _send_plan(self, stage_tokens: tuple[int, ...], mode: str = "eager", profile: bool = False) -> None:
        self.step_id += 1
        flags = {"warmup": mode == "warmup" or self.warming, "capture": mode == "capture", "replay": mode == "replay", "profile": profile}
        self.link.send_plan(wire.StepPlan(self.step_id, stage_tokens, **flags))

    @torch.inference_mode()
    def capture_graphs(self, max_batch: int = 0, buckets: Sequence[int] = (), mixed_tokens: int = 0) -> DecodeGraphs:
        """Warm up and capture decode graphs up to `max_batch` sequences, or of exactly `buckets`, and piecewise
        graphs for prompt steps up to `mixed_tokens` tokens (0: none); the FFN follows the plans."""
        started = time.monotonic()
        buckets = tuple(sorted(set(buckets))) or decode_buckets(max_batch, self.stages)
        device = self.kv_cache.keys[0].device
        self.graphs = DecodeGraphs(
            self.forward, self.kv_cache, buckets, self.policy, device, before=self._send_plan,
        )
        self.graphs.capture_all()
        if mixed_tokens:
            self.mixed_graphs = MixedGraphs(self.model, self.kv_cache, token_buckets(mixed_tokens), device,
                                            pool=self.graphs.pool, ffn=self._exchange, before=self._send_plan,
                                            stages=self.stages)
            self.mixed_graphs.capture_all()
        self.link.wait_step()
        self.capture_seconds = time.monotonic() - started
        return self.graphs

    def on_link_lost(self) -> None:
        """The graphs replayed the lost connection's transfers: release them."""
        if self.graphs is not None:
            self._lost_buckets = self.graphs.buckets
        if self.mixed_graphs is not None:
            self._lost_mixed_tokens = max(self.mixed_graphs.buckets)
        self.graphs = self.mixed_graphs = None

    def on_link_back(self) -> None:
        """Capture the graphs again; this also re-warms the FFN's graph cache (its plans drive it)."""
        if self._lost_buckets is not None:
            self.capture_graphs(buckets=self._lost_buckets, mixed_tokens=self._lost_mixed_tokens)
            self._lost_buckets, self._lost_mixed_tokens = None, 0

    def _collect(self, mb: _MicroBatch, norm=None) -> None:
        """Add the FFN output awaited to the residual stream; with the next layer's input `norm`, in one launch
        with that norm (`RMSNorm.add_forward`: the same bits as the add, then the norm)."""
        if mb.waiting is not None:
            waiting = self.clock.now()
            output = self.link.recv(mb.waiting).to(mb.hidden.dtype)
            if norm is None:
                mb.hidden = mb.hidden + output
            else:
                mb.hidden, mb.normed = norm.add_forward(output, mb.hidden)
            self.clock.lap("recv", mb.waiting.layer, waiting)
            mb.waiting = None
