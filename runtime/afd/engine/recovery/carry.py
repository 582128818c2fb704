"""Requests carried over from another rank: the prompt plus the tokens a client already has, continued from there.

A carried request prefills `prompt + carried` and samples only what is left of `max_tokens`; its
usage still counts the original prompt and every output token once (`Request.carried`). So that
the client's text goes on exactly as an undisturbed run's would:

- a seeded request's random generator is advanced by one draw per carried token: the sampler draws
  one `multinomial` over the vocabulary per output token, and how far that moves the generator
  depends only on the vocabulary's width, never on the probabilities;
- the incremental detokenizer and the stop-string checker replay the carried tokens, so the first
  new token's text is only what it adds (a character split across tokens, a held-back stop prefix).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from afd.engine.request import InvalidRequest, SamplingParams


def seeded_generator(seed: int, draws: int, vocab: int, device: torch.device | str) -> torch.Generator:
    """A generator seeded with `seed` and advanced as `draws` samples over `vocab` tokens advance it."""
    generator = torch.Generator(device=device).manual_seed(seed)
    if draws:
        uniform = torch.ones(vocab, dtype=torch.float32, device=device)
        for _ in range(draws):
            torch.multinomial(uniform, 1, generator=generator)
    return generator


def carried_params(params: SamplingParams, carried: int) -> SamplingParams:
    """`params` for the rest of a request that already produced `carried` tokens."""
    if carried >= params.max_tokens:
        raise InvalidRequest(f"{carried} tokens carried over leave nothing to generate within max_tokens "
                             f"({params.max_tokens})", "max_tokens")
    return dataclasses.replace(params, max_tokens=params.max_tokens - carried,
                               min_tokens=max(0, params.min_tokens - carried))


def prime_text(detokenizer, checker, carried: Sequence[int]) -> None:
    """Replay `carried` through the detokenizer and the stop checker as their first delivery did (text taken, not
    sent again)."""
    for token in carried:
        delta = detokenizer.add(token)
        if checker is not None:
            checker.add(delta)
            checker.take(final=False)
