"""Each step's grammar masks: which tokens each grammar-following row may sample, on the device.

The structured rows' allowed-token bitmasks are filled on the host ([R, ceil(V / 32)] int32) from
their matchers (`afd.engine.structured_output.grammars`), copied to the device without waiting, and
unpacked there into -inf on disallowed logits. A grammar that is complete allows only EOS, so the
request ends there.
"""

from __future__ import annotations

import torch

from afd.engine.structured_output.grammars import consume
from afd.step.host_copy import host_to_device


def fill_bitmask(matchers: list, vocab_size: int, eos_token_ids) -> torch.Tensor:
    """[R, ceil(V / 32)] int32 on the host: bit t of row r set when token t is allowed for `matchers[r]`. A failed
    matcher (it cannot happen with its own mask) allows only EOS, so the request ends."""
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        if matcher.is_error():
            bitmask[row].zero_()
            for token in eos_token_ids:
                bit = token % 32
                bitmask[row, token // 32] |= -(1 << 31) if bit == 31 else 1 << bit  # int32: bit 31 is the sign
        else:  # llguidance writes the row in place (its torch helper does the same)
            matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), words * 4)
    return bitmask


class StepMask:
    """One step's grammar masks on the device, for rows `rows` of the sampled logits."""

    def __init__(self, rows: list[int], bitmask: torch.Tensor, device: torch.device):
        self.rows = host_to_device(torch.tensor(rows, dtype=torch.long), device)
        self.bitmask = host_to_device(bitmask, device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with the disallowed tokens of the masked rows at -inf (in place on a tensor the sampler owns)."""
        vocab = logits.shape[1]
        bits = torch.arange(32, dtype=torch.int32, device=logits.device)
        unpacked = ((self.bitmask.unsqueeze(-1) >> bits) & 1).flatten(1).bool()
        allowed = torch.zeros((len(self.rows), vocab), dtype=torch.bool, device=logits.device)
        width = min(vocab, unpacked.shape[1])
        allowed[:, :width] = unpacked[:, :width]
        logits[self.rows] = logits[self.rows].masked_fill(~allowed, float("-inf"))
        return logits


def step_mask(sampling: list, vocab_size: int, eos_token_ids, device: torch.device) -> StepMask | None:
    """The grammar masks of one step's sampling rows that follow a grammar (None: none do); their matchers must have
    taken every earlier token."""
    rows = [i for i, r in enumerate(sampling) if r.grammar is not None]
    if not rows:
        return None
    return StepMask(rows, fill_bitmask([sampling[i].grammar for i in rows], vocab_size, eos_token_ids), device)


def consume_step(batch: list, tokens: list[int]) -> None:
    """Each grammar-following request of a read step takes its sampled token."""
    for request, token in zip(batch, tokens):
        if request.grammar is not None:
            consume(request.grammar, token)
