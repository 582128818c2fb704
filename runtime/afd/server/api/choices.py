"""`n` choices and `best_of` candidates of one prompt, as engine requests and back.

Each choice is its own engine request; the choices of one prompt are submitted together as one
group, so the engine prefills the prompt once and they share its full KV blocks
(`afd.engine.scheduling.shared_prompt`). Choice j draws from its own seed stream: with `seed` s it is seeded
s + j, so it equals an `n: 1` request with seed s + j. With `best_of` > n, `best_of` candidates
run and the n with the highest cumulative log-probability are returned (OpenAI's rule); usage
counts every candidate's tokens, and the prompt once.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from afd.engine.request import RequestOutput, SamplingParams


def candidate_params(params: SamplingParams, n: int, best_of: int | None) -> list[SamplingParams]:
    """The engine parameters of each candidate of one prompt (`best_of` of them, else `n`)."""
    count = max(n, best_of or n)
    ranked = count > n
    logprobs = params.logprobs if params.logprobs is not None or not ranked else 0  # ranking reads each token's logprob
    return [dataclasses.replace(params, seed=None if params.seed is None else params.seed + j, logprobs=logprobs)
            for j in range(count)]


def cumulative_logprob(outputs: Sequence[RequestOutput]) -> float:
    return sum(entry.logprob for output in outputs for entry in output.logprobs)


def pick_best(candidates: list[list[RequestOutput]], n: int, keep_logprobs: bool) -> list[list[RequestOutput]]:
    """The `n` candidates of one prompt to return: all of them when there are `n`, else the likeliest first
    (stable); their token logprobs dropped unless the client asked for them."""
    if len(candidates) == n:
        return candidates
    chosen = sorted(candidates, key=cumulative_logprob, reverse=True)[:n]
    if keep_logprobs:
        return chosen
    return [[dataclasses.replace(output, logprobs=[]) for output in outputs] for outputs in chosen]


def cached_tokens(candidates: Sequence[Sequence[RequestOutput]], per_prompt: int) -> int:
    """Prompt tokens found in the prefix cache: each prompt once (the most any of its `per_prompt` candidates found)."""
    found = [max((o.cached_tokens for o in outputs), default=0) for outputs in candidates]
    return sum(max(found[i: i + per_prompt], default=0) for i in range(0, len(found), per_prompt))


def completion_tokens(candidates: Sequence[Sequence[RequestOutput]]) -> int:
    """Tokens generated over every candidate (what usage counts)."""
    return sum(outputs[-1].completion_tokens for outputs in candidates if outputs)
