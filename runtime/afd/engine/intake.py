"""A submitted request as the engine takes it: its carried tokens, seed stream, grammar matcher and text state."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from afd.engine.recovery.carry import carried_params, prime_text, seeded_generator
from afd.engine.request import Request, RequestOutput, SamplingParams
from afd.engine.structured_output.grammars import Grammars, consume
from afd.engine.text.detokenizer import IncrementalDetokenizer
from afd.engine.text.stop_strings import StopChecker


def new_request(prompt_ids: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], None],
                carried: Sequence[int], group: str | None, request_id: str | None, arrival: float | None) -> Request:
    """The request of `prompt_ids` continued after `carried` output tokens (`afd.engine.recovery.carry`)."""
    sampling = carried_params(params, len(carried)) if carried else params
    request = Request(list(prompt_ids) + list(carried), sampling, on_output)
    request.carried, request.group = len(carried), group
    if request_id is not None:
        request.request_id = request_id
    if arrival is not None:
        request.arrival = min(arrival, request.arrival)
    return request


def prepare(request: Request, params: SamplingParams, carried: Sequence[int], grammars: Callable[[], Grammars],
            vocab_size: int | None, device: torch.device, tokenizer=None) -> None:
    """Give a checked request its grammar matcher, seed stream and (with a `tokenizer`) text state, each gone on from
    where the carried tokens left it."""
    if params.grammar is not None:
        request.grammar = grammars().matcher(params.grammar)
        for token in carried:
            consume(request.grammar, token)
    if params.seed is not None:
        draws = 0 if params.greedy else len(carried)
        request.generator = seeded_generator(params.seed, draws, vocab_size, device)
    if tokenizer is not None:
        request.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens,
                                                     params.spaces_between_special_tokens)
        request.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        prime_text(request.detokenizer, request.stop_checker, carried)
