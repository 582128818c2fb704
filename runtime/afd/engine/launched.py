"""A step as the engine launches it: run with the prompt-logprob rows it asks for, and its record until its sampled
tokens are read on the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.engine.inputs import to_device
from afd.engine.request import Request
from afd.engine.sampling.prompt_logprobs import PromptLogprobs, PromptRows
from afd.engine.sampling.sampler import Sampled
from afd.step.layout import SeqLayout


def run_step(step, input_ids: torch.Tensor, layout: SeqLayout, rows: PromptRows | None, device: torch.device
             ) -> tuple[torch.Tensor, PromptLogprobs | None]:
    """(logits of each sequence's last token, the prompt logprobs of `rows` being copied to the host, or None)."""
    if rows is None:
        return step(input_ids, layout), None
    step.logit_rows = to_device(rows.rows, device)
    try:
        logits = step(input_ids, layout)
    finally:
        step.logit_rows = None
    return logits, PromptLogprobs.compute(step.row_logits, rows).to_host()


@dataclass
class Launched:
    """A step whose sampled tokens are not read on the host yet."""

    batch: list[Request]  # the requests that sample in this step, in the sampled tensor's row order
    sampled: Sampled
    finals: list[Request]  # requests whose last token this step samples
    tokens: int
    prompt_tokens: int
    started: float
    launched: float  # when the launch returned (`StepClock`)
    mark: object = None  # the link's end-of-step mark (`AttentionLink.end_step`), waited on before reading
    prompt: PromptLogprobs | None = None  # prompt logprobs of the step's prompt rows that asked for them
    structured: bool = False  # some rows follow a grammar: their matchers take the tokens when they are read
    written: list | None = None  # (request, prompt position reached) of its prompt chunks: published once read
