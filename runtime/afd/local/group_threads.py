"""A whole AFD group inside one process over the `loopback` connector (tests, debugging).

Every FFN rank and every attention rank runs in its own thread; the code each one
runs is exactly what its pod would run.
"""

from __future__ import annotations

import threading
from typing import Sequence

from afd.local.offline_batch import run_attention_batch, split_prompts
from afd.config import AFDConfig
from afd.engine.generation import GenerationResult
from afd.roles.ffn import build_ffn


def generate_in_threads(
    base: AFDConfig, prompts: Sequence[Sequence[int]], max_tokens: int, ignore_eos: bool = False
) -> GenerationResult:
    """Greedy outputs of `prompts` (in order) from a loopback deployment of `base.topology`."""
    topology = base.topology
    stop = threading.Event()
    ffn_threads = []
    for rank in range(topology.num_ffn):
        for shard in range(base.ffn_expert_parallel):
            runner = build_ffn(base.replace(role="ffn", rank=rank, ffn_shard=shard))
            thread = threading.Thread(target=runner.serve, args=(stop,), name=f"ffn-{rank}.{shard}", daemon=True)
            thread.start()
            ffn_threads.append(thread)
    blocks = split_prompts(len(prompts), topology.num_attention)
    results: dict[int, GenerationResult] = {}
    errors: list[BaseException] = []

    def attention(rank: int) -> None:
        try:
            config = base.replace(role="attention", rank=rank)
            results[rank] = run_attention_batch(config, [prompts[i] for i in blocks[rank]], max_tokens, ignore_eos)
        except BaseException as err:  # surfaced in the caller's thread below
            errors.append(err)

    workers = [threading.Thread(target=attention, args=(rank,), name=f"attn-{rank}") for rank in range(topology.num_attention)]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        stop.set()
        for thread in ffn_threads:
            thread.join(timeout=5)
    if errors:
        raise errors[0]
    return merge_results(blocks, results, len(prompts))


def merge_results(blocks: list[list[int]], results: dict[int, GenerationResult], count: int) -> GenerationResult:
    tokens: list[list[int]] = [[] for _ in range(count)]
    logits: list = [None] * count
    for rank, indices in enumerate(blocks):
        for position, index in enumerate(indices):
            tokens[index] = results[rank].tokens[position]
            logits[index] = results[rank].last_logits[position]
    return GenerationResult(tokens, logits)
