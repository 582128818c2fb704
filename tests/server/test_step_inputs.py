"""A step's inputs say how many of its tokens are prompt tokens: the pacer learns decode-only steps apart."""

import torch

from afd.engine.inputs import build_inputs
from afd.engine.request import Request, SamplingParams


def request(prompt_len: int, cached: int, chunk: int = 0, sample_row: int = -1) -> Request:
    r = Request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=8), lambda out: None, blocks=(0,))
    r.cached_tokens, r.chunk = cached, chunk
    if sample_row >= 0:
        r.sample_step, r.sample_row, r.scheduled_outputs = 0, sample_row, 1
    return r


def test_a_step_whose_only_prompt_row_is_a_one_token_last_chunk_still_counts_one_prompt_token():
    decoding = request(4, 4, sample_row=0)
    last_chunk = request(5, 4, chunk=1)  # samples, like a decode row: one token in, one out
    inputs = build_inputs([decoding, last_chunk], 1, torch.tensor([7]), 64, torch.device("cpu"))
    assert (inputs.num_tokens, inputs.prompt_tokens, inputs.emit) == (2, 1, [0, 1])
    decode_only = build_inputs([decoding], 2, torch.tensor([7, 9]), 64, torch.device("cpu"))
    assert (decode_only.num_tokens, decode_only.prompt_tokens) == (1, 0)
