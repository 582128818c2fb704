"""Steps a GPU rank runs once before it serves, through its real stepper, so that no Triton kernel compiles
while it serves (a compile pauses every stream for 0.1-1 s: issue 33's TTFT).

Graph capture runs the decode step at every captured batch size and the piecewise segments of prompt steps,
but not the attention between those segments: that runs eagerly in each step that carries prompt tokens, and
its kernels specialize on what the step holds. The sequences that add one token beside a prompt take the paged
decode kernel with the queries laid out as the prompt step lays them out (not as the decode graphs do), and
cut their keys into slices when few of them share the device, not when many do. A step past the piecewise
graphs' largest token count, a step that wants prompt logprobs and an attention rank's profiled step run
wholly eagerly, their tensors laid out differently again. The profile step that sizes the KV cache runs one
such step, and none when the cache is sized by hand (`kv_cache_bytes`).

These steps run each layout serving meets: a prompt beside one decoding sequence, beside as many as a
piecewise graph holds and as many as a step holds, a prompt chunk after its cached part, two prompts; each
through the graphs and again wholly eagerly, sampled with the costliest parameters.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from afd.engine.request import MAX_LOGPROBS, SamplingParams
from afd.engine.sampling.sampler import sample
from afd.kv.cache import KVCache
from afd.step.layout import SeqLayout

log = logging.getLogger(__name__)

Layout = tuple[tuple[int, ...], tuple[int, ...]]  # (tokens already cached, tokens added) per sequence


def plan_warm_steps(max_tokens: int, max_seqs: int, block_size: int, max_model_len: int,
                    piecewise_tokens: int = 0) -> list[Layout]:
    """(context_lens, new_lens) of each warm step within the step budget (pure): a prompt chunk after cached
    tokens; a prompt beside one decoding sequence, beside as many as fit in `piecewise_tokens` (the piecewise
    graphs' largest step; 0: none) and as many as fit in the step (`max_seqs`, `max_tokens`); two prompts."""
    if min(max_tokens, max_seqs, block_size, max_model_len) < 1:
        raise ValueError(f"max_tokens {max_tokens}, max_seqs {max_seqs}, block_size {block_size} and "
                         f"max_model_len {max_model_len} must be positive")
    context = min(block_size + 1, max_model_len - 1)  # a decoding sequence's keys span two blocks
    prompt = min(2 * block_size + 3, max_tokens // 2, max_model_len - context)  # not a multiple of anything
    if prompt < 2:  # no room for a prompt (2 tokens or more) beside anything
        return []
    steps: list[Layout] = [((context,), (prompt,))]  # a chunk after its cached part
    most = [min(max_seqs - 1, tokens - prompt) for tokens in (piecewise_tokens, max_tokens) if tokens]
    for count in sorted({1, *most}):  # one-token sequences beside the prompt
        if 1 <= count < max_seqs:
            steps.append(((0,) + (context,) * count, (prompt,) + (1,) * count))
    if max_seqs >= 2 and prompt >= 3 and 2 * prompt - 1 <= max_tokens:
        steps.append(((0, 0), (prompt, prompt - 1)))
    return steps


@torch.inference_mode()
def run_warm_steps(runner, kv_cache: KVCache, vocab_size: int, steps: list[Layout],
                   finish: Callable[[], None] = lambda: None) -> int:
    """Run and sample each of `steps` through `runner` (a monolithic or attention runner), as it serves and again
    wholly eagerly (as a step that wants prompt logprobs: `runner.logit_rows`), on blocks of `kv_cache` released
    after; a layout that does not fit the free blocks is left out. `finish` ends a step (an attention rank waits
    for its FFN). Returns the steps run."""
    started, ran = time.monotonic(), 0
    device = kv_cache.keys[0].device
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=50, top_p=0.9, logprobs=MAX_LOGPROBS)
    for context_lens, new_lens in steps:
        totals = [c + n for c, n in zip(context_lens, new_lens)]
        if sum(kv_cache.blocks_for(t) for t in totals) > kv_cache.free_blocks:
            log.info("warm-up step of %d sequences left out: the KV cache has %d free blocks", len(totals),
                     kv_cache.free_blocks)
            continue
        tables = [tuple(kv_cache.allocate(t)) for t in totals]
        try:
            input_ids = torch.randint(0, vocab_size, (sum(new_lens),), device=device)
            for eager in (False, True):
                runner.logit_rows = torch.zeros(0, dtype=torch.long, device=device) if eager else None
                logits = runner(input_ids, SeqLayout(tuple(tables), context_lens, new_lens))
                finish()
                sample(logits, [params] * len(new_lens), [None] * len(new_lens)).to_host().result()
                ran += 1
        finally:
            runner.logit_rows = runner.row_logits = None
            for table in tables:
                kv_cache.release(table)
    log.info("ran %d warm-up steps with prompt tokens (the eager attention paths) in %.2f s", ran,
             time.monotonic() - started)
    return ran


def warm_rank(config, spec, runner, kv_cache: KVCache, finish: Callable[[], None] = lambda: None) -> int:
    """`run_warm_steps` over the layouts `config`'s step budget and graphs call for (`plan_warm_steps`)."""
    steps = plan_warm_steps(config.max_num_batched_tokens, config.max_num_seqs, kv_cache.block_size,
                            config.max_model_len_of(spec), config.piecewise_graph_tokens)
    return run_warm_steps(runner, kv_cache, spec.vocab_size, steps, finish)
