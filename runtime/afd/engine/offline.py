"""An offline batch through the serving Engine: what `afd generate` runs.

Every prompt is submitted at once with greedy parameters and the Engine schedules them
as it schedules API requests (continuous batching, chunked prefill). The logits that
chose each sequence's last token are kept for `--with-logits` (the Engine's `on_logits`
sees each step's batch and logits, row by row). The loop is not pipelined here, so no step runs after a
sequence's last one. `afd.engine.generation.greedy_generate` stays as the simple reference the
parity tests compare against.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from afd.engine.engine import Engine
from afd.engine.request import RequestOutput, SamplingParams
from afd.engine.generation import GenerationResult, Stepper
from afd.kv.cache import KVCache


class _NoText:
    """Offline batches are token ids in and out: nothing to detokenize."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def generate_with_engine(step: Stepper, kv_cache: KVCache, prompts: Sequence[Sequence[int]], max_tokens: int,
                         eos_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                         device: torch.device | str = "cpu", max_model_len: int | None = None,
                         timeout_s: float = 3600.0, link=None) -> GenerationResult:
    """Greedy tokens of every prompt and the logits that chose each last token; RuntimeError on a failure.
    `link`: the attention runner's FFN link, waited on after each step (it notices a lost FFN)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: must be at least 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if not prompts:
        return GenerationResult([], [])
    last_rows: dict[int, torch.Tensor] = {}  # id(request) -> logits row of its latest step

    def keep(batch: list, logits: torch.Tensor) -> None:
        for request, row in zip(batch, logits):
            last_rows[id(request)] = row

    longest = max(len(p) for p in prompts) + max_tokens
    engine = Engine(step, kv_cache, _NoText(), eos_token_ids, max_num_seqs=len(prompts),
                    max_model_len=max(max_model_len or 0, longest + 1), device=device, pipeline=False, on_logits=keep,
                    link=link)
    done = threading.Event()
    results: list[list[RequestOutput]] = [[] for _ in prompts]
    finished = [0]
    lock = threading.Lock()

    def collect(index: int):
        def on_output(output: RequestOutput) -> None:
            results[index].append(output)
            if output.finished:
                with lock:
                    finished[0] += 1
                    if finished[0] == len(prompts):
                        done.set()
        return on_output

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    engine.start()
    try:
        requests = [engine.submit(list(map(int, p)), params, collect(i)) for i, p in enumerate(prompts)]
        if not done.wait(timeout_s):
            raise RuntimeError(f"the batch did not finish within {timeout_s:.0f} s")
    finally:
        engine.stop()
    errors = [out.error for outs in results for out in outs if out.error]
    if errors:
        raise RuntimeError(f"generation failed: {errors[0]}")
    tokens = [[t for out in outs for t in out.token_ids] for outs in results]
    return GenerationResult(tokens, [last_rows[id(request)].float().cpu() for request in requests])
