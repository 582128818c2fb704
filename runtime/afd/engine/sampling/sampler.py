"""Batched sampling on the device: greedy, temperature, min-p, top-k, top-p, per-request seeds, logprobs.

Logits controls (penalties, logit_bias, allowed/banned tokens, min_tokens) are applied first
when the step has any (`afd.engine.sampling.logits_controls`); logprobs are those of the raw logits,
as vLLM reports them by default.

`sample` never waits for the device: which masks apply is decided from the requests'
parameters on the host, and its result is one packed tensor that `Sampled.to_host`
copies to the host in one transfer (asynchronously on a GPU). Only drawing from seeded
rows is per row, because each seeded request owns its random generator (that is what
makes its output reproducible whatever else is in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.engine.inputs import start_host_copy, to_device
from afd.engine.request import SamplingParams, TokenLogprobs
from afd.engine.sampling.logits_controls import StepControls
from afd.engine.structured_output.step_mask import StepMask


@dataclass
class Sampled:
    """One step's sampled tokens on the device, and their host copy once `to_host` ran."""

    tokens: torch.Tensor  # [B] long, device: the next step's input ids
    packed: torch.Tensor  # [B] long, or [B, 2 + 2K] float64 (token, its logprob, K top ids, K top logprobs)
    top: int  # K; -1 when no row asked for logprobs
    wants: list[int | None]  # each row's requested top count (None: no logprobs)
    host: torch.Tensor | None = None
    ready: object = None  # a CUDA event recorded after the copy, or None

    def to_host(self) -> "Sampled":
        """Start the single device-to-host copy of this step."""
        self.host, self.ready = start_host_copy(self.packed)
        return self

    def wait(self) -> None:
        """Block until the host copy is in."""
        if self.ready is not None:
            self.ready.synchronize()

    def result(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Token ids and logprobs per row (waits for the copy)."""
        self.wait()
        values = self.host.tolist()
        if self.top < 0:
            return values, [None] * len(values)
        tokens = [int(row[0]) for row in values]
        logprobs = [
            None if want is None else TokenLogprobs(
                int(row[0]), row[1], list(zip(map(int, row[2: 2 + want]), row[2 + self.top: 2 + self.top + want])))
            for row, want in zip(values, self.wants)
        ]
        return tokens, logprobs


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           controls: StepControls | None = None, mask: StepMask | None = None) -> Sampled:
    """One token per row of `logits` [B, vocab] float32, plus logprobs where a request asked for them; `controls`
    and the grammar `mask` (structured outputs) adjust the logits first."""
    device, vocab = logits.device, logits.shape[1]
    raw = logits
    if controls is not None:
        logits = controls.apply(logits)
    if mask is not None:
        logits = mask.apply(logits if controls is not None else logits.clone())
    chosen = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        chosen = _draw(logits, chosen, [params[i] for i in random_rows], random_rows, generators, device, vocab)
    if controls is not None:
        controls.record(chosen)
    logits = raw
    wants = [p.logprobs for p in params]
    if all(w is None for w in wants):
        return Sampled(chosen, chosen, -1, wants)
    top = max(w for w in wants if w is not None)
    logprobs = logits.float().log_softmax(dim=-1)
    top_values, top_ids = logprobs.topk(max(top, 1), dim=-1)
    packed = torch.cat([chosen.double().unsqueeze(1), logprobs.gather(1, chosen.unsqueeze(1)).double(),
                        top_ids[:, :top].double(), top_values[:, :top].double()], dim=1)
    return Sampled(chosen, packed, top, wants)


def _draw(logits, chosen, params, rows, generators, device, vocab) -> torch.Tensor:
    """`chosen` with the non-greedy `rows` drawn from their temperature/top-k/top-p distributions."""
    index = to_device(rows, device)
    scores = logits[index] / to_device([max(p.temperature, 1e-6) for p in params], device, logits.dtype).unsqueeze(1)
    if any(p.min_p > 0 for p in params):
        scores = mask_min_p(scores, to_device([p.min_p for p in params], device, logits.dtype))
    if any(0 < p.top_k < vocab for p in params):
        scores = _mask_top_k(scores, to_device([p.top_k if p.top_k > 0 else vocab for p in params], device))
    if any(p.top_p < 1 for p in params):
        scores = _mask_top_p(scores, to_device([p.top_p for p in params], device, logits.dtype))
    probs = scores.softmax(dim=-1)
    seeded = [(j, generators[i]) for j, i in enumerate(rows) if generators[i] is not None]
    drawn = torch.multinomial(probs, 1).squeeze(1)
    for j, generator in seeded:  # a seeded row draws with its own generator, whatever else runs
        drawn[j] = torch.multinomial(probs[j], 1, generator=generator)[0]
    chosen = chosen.clone()
    chosen[index] = drawn
    return chosen


def mask_min_p(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tokens whose probability is below `min_p` [R] times their row's likeliest one's set to -inf."""
    probs = scores.softmax(dim=-1)
    floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return scores.masked_fill(probs < floor, float("-inf"))


def _mask_top_k(scores: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    sorted_scores = scores.sort(dim=-1, descending=True).values
    kth = sorted_scores.gather(1, (top_k - 1).clamp(max=scores.shape[1] - 1).unsqueeze(1))
    return scores.masked_fill(scores < kth, float("-inf"))


def _mask_top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop = (cumulative - sorted_scores.softmax(dim=-1)) >= top_p.unsqueeze(1)  # keep the token that crosses p
    drop_original = torch.zeros_like(drop).scatter(1, order, drop)
    return scores.masked_fill(drop_original, float("-inf"))
