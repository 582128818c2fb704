"""Multi-token `bad_words` on the device, as vLLM bans them: a word's last token gets -inf when the word's other
tokens are the last tokens of the output.

Each request with such words keeps a ring of its last `RING` output tokens on the device and a count of
tokens written (`ControlState.history`, `written`), appended in stream order right after sampling, so the
pipelined loop never reads them on the host. A step takes back its tokens by lowering the count (hold and
resume, `afd.engine.recovery.rewind`); the ring is longer than the longest word by more than the steps that can be
taken back, so what a match reads is never overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.engine.inputs import to_device
from afd.engine.request import MAX_BANNED_SEQUENCE, Request

RING = 2 * MAX_BANNED_SEQUENCE  # output tokens kept per request


def tail_row(carried: list[int]) -> tuple[list[int], int]:
    """A new request's ring (-1: no token) and count: its carried tokens (output of an earlier rank) as if written."""
    row = [-1] * RING
    for position in range(max(0, len(carried) - RING), len(carried)):
        row[position % RING] = carried[position]
    return row, len(carried)


@dataclass
class BannedWords:
    """One step's multi-token bad words: an entry per (sampling row, word)."""

    rows: torch.Tensor  # [P] logits row of each entry
    slots: torch.Tensor  # [P] its request's controls slot
    prefix: torch.Tensor  # [P, L] the word's tokens but the last, left-aligned (padding not compared)
    lengths: torch.Tensor  # [P] how many of them
    last: torch.Tensor  # [P] the token banned on a match
    tracked_rows: torch.Tensor  # [T] rows whose requests have such words (their tokens are kept)
    tracked_slots: torch.Tensor  # [T]

    def apply(self, logits: torch.Tensor, history: torch.Tensor, written: torch.Tensor) -> None:
        """-inf (in place) on each word's last token where its prefix ends the output."""
        offsets = torch.arange(self.prefix.shape[1], device=logits.device)
        positions = written[self.slots].unsqueeze(1) - self.lengths.unsqueeze(1) + offsets  # [P, L]
        seen = history[self.slots.unsqueeze(1), positions.remainder(RING)]
        compared = offsets < self.lengths.unsqueeze(1)
        match = (((seen == self.prefix) & (positions >= 0)) | ~compared).all(dim=1)
        penalty = torch.where(match, float("-inf"), 0.0).to(logits.dtype)
        logits.index_put_((self.rows, self.last), penalty, accumulate=True)

    def record(self, chosen: torch.Tensor, history: torch.Tensor, written: torch.Tensor) -> None:
        """Append the step's sampled tokens of the tracked rows (device only)."""
        history[self.tracked_slots, written[self.tracked_slots].remainder(RING)] = chosen[self.tracked_rows].long()
        written[self.tracked_slots] += 1

    def undo(self, written: torch.Tensor) -> None:
        """Take back the tokens `record` appended (the step was lost)."""
        written[self.tracked_slots] -= 1


def step_words(requests: list[Request], slots: dict[Request, int], device: torch.device) -> BannedWords | None:
    """The entries of `requests` (the step's sampling rows, in order; `slots`: their controls slots), or None."""
    rows, entry_slots, prefixes, lengths, last, tracked_rows, tracked_slots = [], [], [], [], [], [], []
    for row, request in enumerate(requests):
        words = request.params.banned_sequences
        if not words:
            continue
        slot = slots[request]
        tracked_rows.append(row)
        tracked_slots.append(slot)
        for word in words:
            rows.append(row)
            entry_slots.append(slot)
            prefixes.append(list(word[:-1]))
            lengths.append(len(word) - 1)
            last.append(word[-1])
    if not rows:
        return None
    width = max(lengths)
    padded = [p + [0] * (width - len(p)) for p in prefixes]
    return BannedWords(to_device(rows, device), to_device(entry_slots, device),
                       to_device(padded, device).reshape(len(rows), width), to_device(lengths, device),
                       to_device(last, device), to_device(tracked_rows, device), to_device(tracked_slots, device))
