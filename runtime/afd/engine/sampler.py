"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

The masks and softmax run once for the whole batch; only drawing from seeded rows is
per row, because each seeded request owns its random generator (that is what makes
its output reproducible whatever else is in the batch).
"""

from __future__ import annotations

import torch

from afd.engine.request import SamplingParams, TokenLogprobs


def sample(
    logits: torch.Tensor,  # [B, vocab] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row, plus its logprobs when the request asked for them."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[1] for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    greedy = torch.tensor([p.greedy for p in params], device=device)
    scaled = logits / temperature.clamp(min=1e-6).unsqueeze(1)
    scaled = _mask_top_k(scaled, top_k)
    scaled = _mask_top_p(scaled, top_p)
    probs = scaled.softmax(dim=-1)
    chosen = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    unseeded = [i for i in random_rows if generators[i] is None]
    if unseeded:
        chosen[unseeded] = torch.multinomial(probs[unseeded], 1).squeeze(1)
    for i in random_rows:
        if generators[i] is not None:
            chosen[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    chosen = torch.where(greedy, logits.argmax(dim=-1), chosen)
    tokens = chosen.tolist()
    return tokens, _logprobs(logits, tokens, params)


def _mask_top_k(scores: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    if bool((top_k >= scores.shape[1]).all()):
        return scores
    sorted_scores = scores.sort(dim=-1, descending=True).values
    kth = sorted_scores.gather(1, (top_k - 1).clamp(max=scores.shape[1] - 1).unsqueeze(1))
    return scores.masked_fill(scores < kth, float("-inf"))


def _mask_top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    if bool((top_p >= 1).all()):
        return scores
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop = (cumulative - sorted_scores.softmax(dim=-1)) >= top_p.unsqueeze(1)  # keep the token that crosses p
    drop_original = torch.zeros_like(drop).scatter(1, order, drop)
    return scores.masked_fill(drop_original, float("-inf"))


def _logprobs(logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not wanted:
        return result
    logprobs = logits[wanted].float().log_softmax(dim=-1)
    widest = max(params[i].logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(max(widest, 1), dim=-1)
    for row, i in enumerate(wanted):
        count = params[i].logprobs
        top = list(zip(top_ids[row, :count].tolist(), top_values[row, :count].tolist()))
        result[i] = TokenLogprobs(tokens[i], float(logprobs[row, tokens[i]]), top)
    return result
