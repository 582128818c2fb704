"""One step's inputs, built in a single pass over the batch without waiting for the device.

A decoding request's input token is the one it sampled in the previous step: it is read
from that step's device tensor (`prev_tokens`, row `sample_row`), so the host never waits
for it. A prompt is fed in the chunk the scheduler gave it; only a request whose prompt is
complete after this step samples (`emit`), and one whose last token this step samples is
`final_scheduled` (length limits are known in advance). The riders of a prompt's leader sample from its row in
the step that feeds its last chunk (`afd.engine.shared_prompt`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.engine.request import Request
from afd.engine.shared_prompt import board
from afd.host_copy import host_to_device
from afd.layout import SeqLayout


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    layout: SeqLayout
    emit: list[int]  # rows of the batch's logits that sample, in order (a leader's row again for each rider)
    sampling: list[Request]  # the requests that sample, in emit's order
    params: list  # their sampling parameters and generators
    generators: list
    finals: list[Request]  # requests whose last token this step samples
    num_tokens: int
    prompt_tokens: int  # of them, prompt tokens (0: a decode-only step)
    copies: list  # (from block, to block, rows) to copy before the step: riders' last prompt blocks


def riders_of(batch: list[Request]) -> list[Request]:
    """Requests that may ride a leader of `batch` in its step (their state is the step's to take back)."""
    return [rider for request in batch if request.riders for rider in request.riders
            if rider.cached_tokens < len(rider.prompt_ids)]


def build_inputs(batch: list[Request], step_id: int, prev_tokens: torch.Tensor, max_model_len: int,
                 device: torch.device, block_size: int = 0) -> StepInputs:
    """The inputs of step `step_id`; advances each request's scheduling state as if the step ran."""
    ids, positions, rows, tables, context, new_lens, params, generators, finals, emit = [], [], [], [], [], [], [], [], [], []
    sampling, copies = [], []
    for row, request in enumerate(batch):
        if request.copy_tail is not None:
            copies.append(request.copy_tail)
            request.copy_tail = None
        if request.sample_step >= 0:
            if request.sample_step != step_id - 1:
                raise RuntimeError(f"request {request.request_id} missed step {step_id - 1}: its next input is lost")
            positions.append(len(ids))
            rows.append(request.sample_row)
            ids.append(0)
            new = 1
        else:
            new = request.chunk
            ids.extend(request.prompt_ids[request.cached_tokens: request.cached_tokens + new])
        tables.append(request.blocks)
        context.append(request.cached_tokens)
        new_lens.append(new)
        request.cached_tokens += new
        if request.cached_tokens < len(request.prompt_ids):
            continue  # a prompt chunk that is not the last one: nothing to sample
        for sampler in [request, *board(request, block_size)] if request.riders else (request,):
            emit.append(row)
            sampling.append(sampler)
            params.append(sampler.params)
            generators.append(sampler.generator)
            sampler.scheduled_outputs += 1
            sampler.sample_step, sampler.sample_row = step_id, len(emit) - 1
            if (sampler.scheduled_outputs >= sampler.params.max_tokens
                    or len(sampler.prompt_ids) + sampler.scheduled_outputs >= max_model_len):
                sampler.final_scheduled = True
                finals.append(sampler)
    if len(positions) == len(ids) == len(prev_tokens) and rows == list(range(len(prev_tokens))):
        input_ids = prev_tokens  # steady decoding: last step's tokens are this step's inputs as they are
    else:
        input_ids = to_device(ids, device)
        if positions:
            input_ids[to_device(positions, device)] = prev_tokens[to_device(rows, device)]
    layout = SeqLayout(tuple(tables), tuple(context), tuple(new_lens))
    return StepInputs(input_ids, layout, emit, sampling, params, generators, finals, len(ids), len(ids) - len(positions),
                      copies)


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` as a tensor on `device`, copied without waiting for it (`host_to_device`)."""
    return host_to_device(torch.tensor(values, dtype=dtype), torch.device(device))


def start_host_copy(packed: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(host tensor, CUDA event or None): a device tensor's copy into pinned memory, started without waiting
    (the event is recorded after it); a host tensor is its own copy."""
    if packed.device.type != "cuda":
        return packed, None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
