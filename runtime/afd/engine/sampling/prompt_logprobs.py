"""Prompt log-probabilities from the prefill (`prompt_logprobs`, and `echo` with `logprobs`).

In a step that feeds prompt tokens of a request that asked for them, the logits of every such
token row are taken besides the last ones (the runner's `logit_rows`, an eager step): row of
prompt position p predicts prompt token p + 1. Their log-softmax, the prompt token's
log-probability, its rank (1 = the likeliest) and the top K alternatives are packed on the
device and copied to the host in one transfer, like the sampled tokens; a prompt fed in
several chunks gets its rows over several steps. The first prompt token has none (null).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.engine.inputs import start_host_copy, to_device
from afd.engine.request import Request, TokenLogprobs
from afd.step.layout import SeqLayout


@dataclass
class PromptRows:
    """The step's token rows whose logits give prompt logprobs."""

    requests: list[tuple[Request, int]]  # each request with prompt rows in this step, and how many
    rows: list[int]  # flat token rows of the step
    targets: list[int]  # the prompt token each row predicts
    top: int  # alternatives to report (the largest any of them asked for)


def prompt_rows(batch: list[Request], layout: SeqLayout) -> PromptRows | None:
    """The rows of `batch`'s requests that asked for prompt logprobs and feed prompt tokens this step, or None."""
    requests, rows, targets, offset = [], [], [], 0
    for request, context, new in zip(batch, layout.context_lens, layout.new_lens):
        prompt = request.prompt_ids
        if request.params.prompt_logprobs is not None and context < len(prompt):
            positions = range(context, min(context + new, len(prompt) - 1))
            rows.extend(offset + p - context for p in positions)
            targets.extend(prompt[p + 1] for p in positions)
            requests.append((request, len(positions)))
        offset += new
    if not requests:
        return None
    return PromptRows(requests, rows, targets, max(r.params.prompt_logprobs for r, _ in requests))


@dataclass
class PromptLogprobs:
    """One step's prompt logprobs on the device, and their host copy once `to_host` ran."""

    requests: list[tuple[Request, int]]
    packed: torch.Tensor  # [R, 3 + 2K] float64: target, its logprob, its rank, K top ids, K top logprobs
    top: int
    host: torch.Tensor | None = None
    ready: object = None

    @classmethod
    def compute(cls, logits: torch.Tensor, rows: PromptRows) -> "PromptLogprobs":
        """From the row logits [R, vocab] of `rows` (device work only)."""
        logprobs = logits.float().log_softmax(dim=-1)
        targets = to_device(rows.targets, logits.device).unsqueeze(1)
        chosen = logprobs.gather(1, targets)
        rank = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
        parts = [targets.double(), chosen.double(), rank.double()]
        if rows.top:
            values, ids = logprobs.topk(rows.top, dim=-1)
            parts += [ids.double(), values.double()]
        return cls(rows.requests, torch.cat(parts, dim=1), rows.top)

    def to_host(self) -> "PromptLogprobs":
        self.host, self.ready = start_host_copy(self.packed)
        return self

    def result(self) -> list[tuple[Request, list[TokenLogprobs]]]:
        """Each request's entries of this step, in prompt order (waits for the copy)."""
        if self.ready is not None:
            self.ready.synchronize()
        values, top, start, result = self.host.tolist(), self.top, 0, []
        for request, count in self.requests:
            want = request.params.prompt_logprobs
            entries = [TokenLogprobs(int(row[0]), row[1], list(zip(map(int, row[3: 3 + want]), row[3 + top: 3 + top + want])),
                                     int(row[2])) for row in values[start: start + count]]
            result.append((request, entries))
            start += count
        return result
