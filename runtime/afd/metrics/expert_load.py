"""Tokens routed to each expert of an FFN process, per layer, on sampled (profiled) steps.

`afd_expert_tokens_total{role,rank,shard,layer,expert}` (global expert ids) shows how evenly the
router spreads tokens over the experts, and, with expert parallelism, over the shards: a hot shard
bounds the step. Counting happens only on the steps attention marks `profile` (they run eagerly),
into one device buffer per layer; the step's counts reach the host once, at its end.
"""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from afd.models.layers import MoE


class ExpertLoad:
    """Per-layer token counts of the experts this process holds."""

    def __init__(self, layers, crossing: tuple[int, ...]):
        self.moe = {i: layers[i].mlp for i in crossing if isinstance(layers[i].mlp, MoE) and layers[i].mlp.experts is not None}
        self.norms = {i: layers[i].post_attention_layernorm for i in self.moe}
        self.totals: dict[int, list[int]] = {i: [0] * moe.experts.num_experts for i, moe in self.moe.items()}
        self._pending: dict[int, torch.Tensor] = {}

    def record(self, layer: int, hidden: torch.Tensor, router_logits: torch.Tensor | None) -> None:
        """Count the tokens of `hidden` ([tokens, hidden], before the norm unless logits are shipped) per expert."""
        moe = self.moe.get(layer)
        if moe is None or hidden.shape[0] == 0:
            return
        if router_logits is None:
            router_logits = moe.gate(self.norms[layer](hidden))
        _, ids = moe.routing.select(router_logits, hidden.dtype)  # [tokens, k] global ids
        local = ids.reshape(-1) - moe.experts.first
        inside = (local >= 0) & (local < moe.experts.num_experts)
        counts = torch.zeros(moe.experts.num_experts, dtype=torch.long, device=ids.device)  # no host sync (bincount has one)
        counts.scatter_add_(0, torch.where(inside, local, torch.zeros_like(local)), inside.long())
        self._pending[layer] = self._pending[layer] + counts if layer in self._pending else counts

    def flush(self) -> None:
        """End of a sampled step: its counts to the host (one copy for every layer)."""
        if not self._pending:
            return
        layers = list(self._pending)
        rows = torch.stack([self._pending[i] for i in layers]).cpu().tolist()
        self._pending.clear()
        for layer, row in zip(layers, rows):
            totals = self.totals[layer]
            for expert, count in enumerate(row):
                totals[expert] += count


class ExpertLoadCollector:
    """Exports an `ExpertLoad` at scrape time."""

    def __init__(self, registry: CollectorRegistry, rank: int, shard: int, load: ExpertLoad):
        self.labels = {"role": "ffn", "rank": str(rank), "shard": str(shard)}
        self.load = load
        registry.register(self)

    def describe(self):
        return [CounterMetricFamily("afd_expert_tokens", "Tokens routed to each expert of this process (profiled steps)",
                                    labels=[*self.labels, "layer", "expert"])]

    def collect(self):
        family = CounterMetricFamily("afd_expert_tokens", "Tokens routed to each expert of this process (profiled steps)",
                                     labels=[*self.labels, "layer", "expert"])
        for layer, totals in sorted(self.load.totals.items()):
            first = self.load.moe[layer].experts.first
            for expert, count in enumerate(totals):
                family.add_metric([*self.labels.values(), str(layer), str(first + expert)], count)
        yield family


def shard_labelled(registry: CollectorRegistry, shard: int) -> CollectorRegistry:
    """`registry`'s series with `shard` added to each: the G processes of one FFN rank otherwise
    export identical series, which a merged exposition (`afd up`'s front door) cannot hold twice."""

    class _Labelled:
        def collect(self):
            for family in registry.collect():
                family.samples = [s if "shard" in s.labels else s._replace(labels={**s.labels, "shard": str(shard)})
                                  for s in family.samples]
                yield family

    labelled = CollectorRegistry(auto_describe=False)
    labelled.register(_Labelled())
    return labelled
