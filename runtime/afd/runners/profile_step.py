"""The largest step a rank can be asked for, run once on a scratch KV cache before the real one exists.

Two shapes at the step budget (`max_num_batched_tokens`): the budget spread over
`max_num_seqs` prompts (vLLM's profile run), and what chunked prefill builds under load,
one long chunk beside `max_num_seqs - 1` one-token sequences (prefill attention pads every
sequence to the longest). Each is sampled with the costliest parameters (top-k, top-p,
logprobs). On the attention role the FFN's answer is stood in by zeros of the shape
sent, so no FFN rank needs to be up: the peak is the attention half's own.
"""

from __future__ import annotations

import torch

from afd.config import SchedulerSettings, SplitSettings
from afd.engine.request import MAX_LOGPROBS, SamplingParams
from afd.engine.sampling.sampler import sample
from afd.kv.cache import DEFAULT_BLOCK_SIZE, KVCache
from afd.models.loader import LoadedModel
from afd.runners.attention_runner import AttentionRunner, StepOptions
from afd.runners.monolithic_runner import MonolithicRunner
from afd.step.layout import SeqLayout


def plan_profile_shapes(max_tokens: int, max_seqs: int, max_model_len: int) -> list[tuple[int, ...]]:
    """New tokens per sequence of each profiled step: the budget spread evenly, then one chunk (no longer
    than a prompt can be) among one-token rows."""
    seqs = max(1, min(max_seqs, max_tokens))
    even = tuple(max_tokens // seqs + (i < max_tokens % seqs) for i in range(seqs))
    mixed = (max(1, min(max_tokens - (seqs - 1), max_model_len - 1)),) + (1,) * (seqs - 1)
    return [even] if mixed == even else [even, mixed]


class StandInFFN:
    """An attention link whose FFN answers zeros of the shape it was sent (profiling, no FFN rank)."""

    def __init__(self):
        self._sent: dict[tuple[int, int], torch.Tensor] = {}

    def send_plan(self, plan) -> None:
        pass

    def send(self, hidden: torch.Tensor, transfer, router_logits: torch.Tensor | None = None) -> None:
        self._sent[(transfer.layer, transfer.stage)] = hidden

    def recv(self, transfer) -> torch.Tensor:
        return torch.zeros_like(self._sent.pop((transfer.layer, transfer.stage)))  # [tokens, hidden]

    def end_step(self) -> None:
        return None

    def wait_step(self, mark=None) -> None:
        pass


def _stepper(role: str, split: SplitSettings, loaded: LoadedModel, kv_cache: KVCache):
    if role == "monolithic":
        return MonolithicRunner(loaded, kv_cache)
    return AttentionRunner(loaded, StandInFFN(), kv_cache, StepOptions.of(split))


@torch.inference_mode()
def run_largest_steps(role: str, scheduler: SchedulerSettings, split: SplitSettings, loaded: LoadedModel,
                      dtype: torch.dtype, device: torch.device, max_model_len: int) -> None:
    """Run and sample each profiled shape of `scheduler`'s step budget on a `role` (attention or monolithic)
    rank, over a scratch KV cache of `dtype` (the serving cache's); nothing is kept."""
    shapes = plan_profile_shapes(scheduler.max_num_batched_tokens, scheduler.max_num_seqs, max_model_len)
    most = max(len(shape) for shape in shapes)
    scratch_tokens = scheduler.max_num_batched_tokens + most * DEFAULT_BLOCK_SIZE
    kv_cache = KVCache.for_tokens(loaded.model.kv_layouts(), scratch_tokens, dtype, device)
    step = _stepper(role, split, loaded, kv_cache)
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=50, top_p=0.9, logprobs=MAX_LOGPROBS)
    vocab = loaded.spec.vocab_size
    for new_lens in shapes:
        tables = [tuple(kv_cache.allocate(n)) for n in new_lens]
        input_ids = torch.randint(0, vocab, (sum(new_lens),), device=device)
        logits = step(input_ids, SeqLayout(tuple(tables), (0,) * len(new_lens), new_lens))  # [seqs, vocab]
        sample(logits, [params] * len(new_lens), [None] * len(new_lens)).to_host().result()
        for table in tables:
            kv_cache.release(table)
