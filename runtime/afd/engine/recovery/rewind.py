"""Taking back launched steps whose FFN rank was lost before their tokens were read (hold and resume).

The pipelined loop advances each request's scheduling state when it builds a step (tokens fed,
outputs scheduled, where its next input lies). A step lost with its FFN rank never delivered a
token, so that state is put back as it was before the step: the KV cache still holds every
token of the steps that were read (what the lost step wrote beyond them is written again), and
the next step is built from the last step that was read. A seeded request's generator, the
device token counts of the logits controls and the output tails of multi-token bad words are put
back too, so the stream goes on exactly as if the FFN had never left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from afd.engine.recovery.carry import seeded_generator
from afd.engine.request import Request


@dataclass
class StepUndo:
    """A launched step's effects on its requests, until its tokens are read."""

    step_id: int  # the engine's step count before this step
    prev_tokens: torch.Tensor  # the sampled tokens it was built from
    rows: list[tuple] = field(default_factory=list)  # (request, cached_tokens, scheduled_outputs, final, step, row)
    controls: object = None  # its `StepControls`, whose counts took its tokens
    chosen: torch.Tensor | None = None  # its sampled tokens (device)


def snapshot(batch: list[Request], step_id: int, prev_tokens: torch.Tensor) -> StepUndo:
    """Before building a step over `batch`: what to restore should the step be lost."""
    return StepUndo(step_id, prev_tokens, [(r, r.cached_tokens, r.scheduled_outputs, r.final_scheduled, r.sample_step,
                                            r.sample_row) for r in batch])


def rewind(undos: list[StepUndo], vocab: int, device: torch.device) -> tuple[int, torch.Tensor, set[Request]]:
    """Undo the lost steps `undos` (oldest first); (step count, sampled tokens) to build the next step from, and the
    requests that were put back."""
    touched: set[Request] = set()
    for undo in reversed(undos):
        controls = undo.controls
        if controls is not None and controls.penalized and undo.chosen is not None:
            minus = torch.full((len(controls.slots),), -1, dtype=torch.int32, device=undo.chosen.device)
            controls.state.counts.index_put_((controls.slots, undo.chosen[controls.rows]), minus, accumulate=True)
        if controls is not None and controls.words is not None and undo.chosen is not None:
            controls.words.undo(controls.state.written)
        for request, cached, outputs, final, step, row in undo.rows:
            request.cached_tokens, request.scheduled_outputs, request.final_scheduled = cached, outputs, final
            request.sample_step, request.sample_row = step, row
            touched.add(request)
    for request in touched:  # a lost step may have drawn from a seeded generator: draw again from the same place
        if request.params.seed is not None and not request.params.greedy:
            request.generator = seeded_generator(request.params.seed, request.carried + request.scheduled_outputs,
                                                 vocab, device)
    return undos[0].step_id, undos[0].prev_tokens, touched
