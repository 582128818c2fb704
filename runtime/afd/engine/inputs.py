"""One step's inputs, built in a single pass over the batch without waiting for the device.

A decoding request's input token is the one it sampled in the previous step: it is read
from that step's device tensor (`prev_tokens`, row `sample_row`), so the host never waits
for it. A prompt is fed in the chunk the scheduler gave it; only a request whose prompt is
complete after this step samples (`emit`), and one whose last token this step samples is
`final_scheduled` (length limits are known in advance). The riders of a prompt's leader sample from its row in
the step that feeds its last chunk (`afd.engine.scheduling.shared_prompt`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.engine.request import Request
from afd.engine.scheduling.shared_prompt import board
from afd.step.host_copy import host_to_device
from afd.step.layout import SeqLayout


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
    copies: list  # (from block, to block, rows) to copy before the next step: riders' last prompt blocks
    written: list  # (request, prompt position its keys and values reach after this step) of the prompts it feeds
    boarded: bool = False  # some rows sample from a leader's logits row (emit repeats it)


def riders_of(batch: list[Request], leaders: set[Request]) -> list[Request]:
    """Requests that may ride a leader of `batch` in its step (their state is the step's to take back)."""
    if not leaders:
        return []
    return [rider for request in batch if request in leaders for rider in request.riders
            if rider.cached_tokens < len(rider.prompt_ids)]


def build_inputs(batch: list[Request], step_id: int, prev_tokens: torch.Tensor, max_model_len: int,
                 device: torch.device, block_size: int = 0, leaders: set[Request] | None = None) -> StepInputs:
    """The inputs of step `step_id`; advances each request's scheduling state as if the step ran. `leaders`: the
    requests whose riders sample from their row in the step that feeds their last prompt chunk."""
    ids, positions, rows, tables, context, new_lens, params, generators, finals, emit = [], [], [], [], [], [], [], [], [], []
    boarded, copies = [], []  # (emit position, rider); riders' last prompt blocks to copy before the next step
    written = []  # (request, prompt position reached) of the prompt chunks fed (published once the step is read)
    leaders = leaders or None
    for row, request in enumerate(batch):
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
            written.append((request, request.cached_tokens + new))
        tables.append(request.blocks)
        context.append(request.cached_tokens)
        new_lens.append(new)
        request.cached_tokens += new
        if request.cached_tokens < len(request.prompt_ids):
            continue  # a prompt chunk that is not the last one: nothing to sample
        emit.append(row)
        params.append(request.params)
        generators.append(request.generator)
        request.scheduled_outputs += 1
        request.sample_step, request.sample_row = step_id, len(emit) - 1
        if (request.scheduled_outputs >= request.params.max_tokens
                or len(request.prompt_ids) + request.scheduled_outputs >= max_model_len):
            request.final_scheduled = True
            finals.append(request)
        if leaders is not None and request in leaders:
            for rider in board(request, block_size, copies):
                emit.append(row)
                boarded.append((len(emit) - 1, rider))
                params.append(rider.params)
                generators.append(rider.generator)
                rider.scheduled_outputs += 1
                rider.sample_step, rider.sample_row = step_id, len(emit) - 1
                if (rider.scheduled_outputs >= rider.params.max_tokens
                        or len(rider.prompt_ids) + rider.scheduled_outputs >= max_model_len):
                    rider.final_scheduled = True
                    finals.append(rider)
    if len(positions) == len(ids) == len(prev_tokens) and rows == list(range(len(prev_tokens))):
        input_ids = prev_tokens  # steady decoding: last step's tokens are this step's inputs as they are
    else:
        input_ids = to_device(ids, device)
        if positions:
            input_ids[to_device(positions, device)] = prev_tokens[to_device(rows, device)]
    layout = SeqLayout(tuple(tables), tuple(context), tuple(new_lens))
    sampling = batch if len(emit) == len(batch) and not boarded else [batch[i] for i in emit]
    for position, rider in boarded:
        sampling[position] = rider
    return StepInputs(input_ids, layout, emit, sampling, params, generators, finals, len(ids), len(ids) - len(positions),
                      copies, written, bool(boarded))


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
