"""Logits controls on the device: penalties, logit bias, allowed and banned tokens, min_tokens.

Only requests that set one of them (`SamplingParams.adjusts_logits`) take part; a batch with
none never builds a `StepControls` and samples exactly as before. Each such request holds a
slot of `ControlState` for its life: a row of output-token counts (int32), a row saying
which tokens its prompt holds, and a row of static additive bias (logit_bias, -inf outside
`allowed_token_ids` and on banned tokens), and for multi-token bad words the output's last tokens
(`afd.engine.sampling.banned_words`). Counts are updated on the device from the sampled
tokens (`StepControls.record`), in stream order right after sampling, so the pipelined loop
never waits for the host; min_tokens is decided on the host from the scheduled output count,
which the engine knows in advance.

Definitions (what vLLM and transformers do):
- repetition_penalty r over the prompt and the output: a seen token's logit l becomes l / r
  if l > 0, else l * r (transformers' RepetitionPenaltyLogitsProcessor);
- frequency_penalty f and presence_penalty p over the output (OpenAI): l - f * count - p * (count > 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.engine.inputs import to_device
from afd.engine.request import Request
from afd.engine.sampling.banned_words import RING, BannedWords, step_words, tail_row
from afd.step.host_copy import host_to_device

MIN_SLOTS = 8


class ControlState:
    """Per-request device rows for the requests with logits controls, in slots that grow on demand."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, torch.device(device)
        self.slots: dict[Request, int] = {}
        self.free: list[int] = []
        self.counts = torch.zeros((0, vocab), dtype=torch.int32, device=self.device)
        self.in_prompt = torch.zeros((0, vocab), dtype=torch.bool, device=self.device)
        self.bias = torch.zeros((0, vocab), dtype=torch.float32, device=self.device)
        self.history = torch.zeros((0, RING), dtype=torch.long, device=self.device)  # multi-token bad words' tails
        self.written = torch.zeros(0, dtype=torch.long, device=self.device)  # (`afd.engine.sampling.banned_words`)

    def release(self, live: set) -> None:
        """Give back the slots of requests no longer in `live` (finished, aborted, failed)."""
        for request in [r for r in self.slots if r not in live]:
            self.free.append(self.slots.pop(request))

    def slot(self, request: Request) -> int:
        """`request`'s slot; on first use its rows are filled (prompt tokens, bias), without waiting."""
        found = self.slots.get(request)
        if found is not None:
            return found
        if not self.free:
            self._grow()
        slot = self.slots[request] = self.free.pop()
        params = request.params
        self.counts[slot].zero_()
        self.in_prompt[slot].zero_()
        prompt = len(request.prompt_ids) - request.carried  # carried: output tokens of an earlier rank, after the prompt
        if params.repetition_penalty != 1:
            self.in_prompt[slot, to_device(request.prompt_ids[:prompt], self.device)] = True
        if request.carried:
            self.counts[slot].index_add_(0, to_device(request.prompt_ids[prompt:], self.device),
                                         torch.ones(request.carried, dtype=torch.int32, device=self.device))
        self.bias[slot] = static_bias(params, self.vocab, self.device)
        if params.banned_sequences:
            row, written = tail_row(request.prompt_ids[prompt:])
            self.history[slot] = to_device(row, self.device)
            self.written[slot] = written
        return slot

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(MIN_SLOTS, 2 * old)
        self.counts = torch.cat([self.counts, self.counts.new_zeros((new - old, self.vocab))])
        self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros((new - old, self.vocab))])
        self.bias = torch.cat([self.bias, self.bias.new_zeros((new - old, self.vocab))])
        self.history = torch.cat([self.history, self.history.new_full((new - old, RING), -1)])
        self.written = torch.cat([self.written, self.written.new_zeros(new - old)])
        self.free.extend(range(new - 1, old - 1, -1))


def static_bias(params, vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] float32 added to the logits every step: logit_bias, -inf outside allowed tokens and on banned ones."""
    bias = torch.zeros(vocab, dtype=torch.float32)
    if params.allowed_token_ids:
        bias.fill_(float("-inf"))
        bias[list(params.allowed_token_ids)] = 0.0
    for token, value in params.logit_bias:
        bias[token] += value
    if params.banned_token_ids:
        bias[list(params.banned_token_ids)] = float("-inf")
    return host_to_device(bias, device)


@dataclass
class StepControls:
    """One step's controls: which rows they touch and with what."""

    state: ControlState
    rows: torch.Tensor  # [R] rows of the step's logits with controls
    slots: torch.Tensor  # [R] their slots
    presence: torch.Tensor  # [R, 1]
    frequency: torch.Tensor  # [R, 1]
    repetition: torch.Tensor  # [R, 1]
    penalized: bool  # any row has a penalty
    held_rows: torch.Tensor | None  # min_tokens: (row, token) pairs set to -inf this step
    held_tokens: torch.Tensor | None
    words: BannedWords | None = None  # multi-token bad words

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [B, vocab] float32 with the controls applied (a new tensor; the input is left alone)."""
        logits = logits.clone()
        sub = logits[self.rows] + self.state.bias[self.slots]
        if self.penalized:
            counts = self.state.counts[self.slots]
            seen = (counts > 0) | self.state.in_prompt[self.slots]
            repeated = torch.where(sub > 0, sub / self.repetition, sub * self.repetition)
            sub = torch.where(seen, repeated, sub)
            sub = sub - self.frequency * counts - self.presence * (counts > 0)
        logits[self.rows] = sub
        if self.held_rows is not None:
            logits[self.held_rows, self.held_tokens] = float("-inf")
        if self.words is not None:
            self.words.apply(logits, self.state.history, self.state.written)
        return logits

    def record(self, chosen: torch.Tensor) -> None:
        """Count the step's sampled tokens (device only)."""
        if self.penalized:
            ones = torch.ones(len(self.slots), dtype=torch.int32, device=chosen.device)
            self.state.counts.index_put_((self.slots, chosen[self.rows]), ones, accumulate=True)
        if self.words is not None:
            self.words.record(chosen, self.state.history, self.state.written)


def step_controls(state: ControlState, requests: list[Request], eos_token_ids: set[int]) -> StepControls | None:
    """The controls of one step's sampling rows (`requests`, in row order), or None when no row has any."""
    rows = [i for i, r in enumerate(requests) if r.params.adjusts_logits]
    if not rows:
        return None
    device = state.device
    params = [requests[i].params for i in rows]
    slots = [state.slot(requests[i]) for i in rows]
    held_rows, held_tokens = [], []
    for row in rows:
        request = requests[row]
        if request.scheduled_outputs <= request.params.min_tokens:  # this step samples output number scheduled_outputs
            held = (set() if request.params.ignore_eos else set(eos_token_ids)) | set(request.params.stop_token_ids)
            held_rows.extend([row] * len(held))
            held_tokens.extend(sorted(held))

    def column(values) -> torch.Tensor:
        return to_device(values, device, torch.float32).unsqueeze(1)

    return StepControls(
        state, to_device(rows, device), to_device(slots, device),
        column([p.presence_penalty for p in params]), column([p.frequency_penalty for p in params]),
        column([p.repetition_penalty for p in params]), any(p.penalized for p in params),
        to_device(held_rows, device) if held_rows else None, to_device(held_tokens, device) if held_tokens else None,
        step_words(requests, state.slots, device))


class Controls:
    """One engine's logits controls: device rows of the requests that set any (`ControlState`), made on first use."""

    def __init__(self):
        self.state: ControlState | None = None

    def held(self) -> bool:
        """Some request still holds a slot (given back at the next step that looks at controls)."""
        return self.state is not None and bool(self.state.slots)

    def for_step(self, sampling: list[Request], logits: torch.Tensor, live, eos_token_ids: set[int]
                 ) -> StepControls | None:
        """This step's controls (None for a batch that sets none: the plain sampler); slots of requests not in `live`
        (running, or in a step that may still be taken back) are given back first."""
        state = self.state
        if state is not None and state.slots:
            state.release(set(live))
        if not any(r.params.adjusts_logits for r in sampling):
            return None
        if state is None:
            state = self.state = ControlState(logits.shape[1], logits.device)
        return step_controls(state, sampling, eos_token_ids)
