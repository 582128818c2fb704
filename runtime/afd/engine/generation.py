"""Greedy generation over a static batch: the reference loop the parity tests compare with
(`afd generate` runs through the serving Engine, `afd.engine.offline`).

The stepper is anything that maps (flattened input ids, sequence layout) to the logits of
each sequence's last token: the monolithic model, or an attention runner whose FFN is
remote. All prompts are in flight together; finished sequences leave the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from afd.kv.cache import KVCache
from afd.step.layout import SeqLayout

Stepper = Callable[[torch.Tensor, SeqLayout], torch.Tensor]


@dataclass
class GenerationResult:
    tokens: list[list[int]]
    last_logits: list[torch.Tensor]  # [vocab] float32, logits that chose each sequence's last token


def greedy_generate(
    step: Stepper,
    kv_cache: KVCache,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    eos_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    device: torch.device | str = "cpu",
) -> GenerationResult:
    """Decode every prompt greedily until `max_tokens` or EOS (unless `ignore_eos`)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: must be at least 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    tables = []
    try:
        for prompt in prompts:
            tables.append(tuple(kv_cache.allocate(len(prompt) + max_tokens)))
        return _decode(step, tables, prompts, max_tokens, set(eos_token_ids), ignore_eos, device)
    finally:
        for table in tables:
            kv_cache.release(table)


def _decode(step, tables, prompts, max_tokens, eos, ignore_eos, device) -> GenerationResult:
    count = len(prompts)
    context = [0] * count
    pending = [list(map(int, p)) for p in prompts]
    tokens: list[list[int]] = [[] for _ in range(count)]
    last_logits: list[torch.Tensor] = [torch.empty(0)] * count
    active = list(range(count))
    while active:
        input_ids = torch.tensor([t for i in active for t in pending[i]], dtype=torch.long, device=device)
        layout = SeqLayout(
            tuple(tables[i] for i in active), tuple(context[i] for i in active), tuple(len(pending[i]) for i in active)
        )
        logits = step(input_ids, layout)  # [len(active), vocab]
        chosen = logits.argmax(dim=-1).tolist()
        for row, i in enumerate(active):
            context[i] += len(pending[i])
            tokens[i].append(chosen[row])
            last_logits[i] = logits[row].float().cpu()
            pending[i] = [chosen[row]]
        active = [
            i for i in active if len(tokens[i]) < max_tokens and (ignore_eos or tokens[i][-1] not in eos)
        ]
    return GenerationResult(tokens, last_logits)
