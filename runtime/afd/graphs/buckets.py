"""Which batch sizes get a CUDA graph, and which graph serves a step. Pure and torch-free.

Attention captures full-decode graphs over padded batch buckets: 1, 2, 4, 8, then every
multiple of 16 up to the largest (nano-vllm's and vLLM's shape), each even when the step
is split in two micro-batches. A batch pads up to the smallest bucket that holds it;
beyond the largest it runs eagerly. Capture goes largest first, so the smaller graphs
reuse the largest one's memory from the shared pool.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence


def decode_buckets(max_batch: int, stages: int = 1) -> tuple[int, ...]:
    """Padded batch sizes to capture, ascending, the last one >= `max_batch`."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch}: must be at least 1")
    if stages not in (1, 2):
        raise ValueError(f"stages={stages}: must be 1 or 2")
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 16, 16))
    if stages == 2:
        sizes = [size for size in sizes if size >= 2]
    cut = next(i for i, size in enumerate(sizes) if size >= max_batch)
    return tuple(sizes[: cut + 1])


def bucket_for(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `batch` sequences; None when it must run eagerly."""
    for size in buckets:
        if size >= batch:
            return size
    return None


def capture_order(buckets: Iterable[int]) -> list[int]:
    """Largest first: later, smaller graphs fit inside the memory the first one took."""
    return sorted(buckets, reverse=True)


def is_decode(new_lens: Sequence[int]) -> bool:
    """A step a decode graph can serve: every sequence adds exactly one token."""
    return len(new_lens) > 0 and all(n == 1 for n in new_lens)


def ffn_graph_key(stage_tokens: Mapping[bytes, Sequence[int]]) -> tuple:
    """Key of an FFN step graph: every peer's per-stage token counts.

    Peers are connection identities, and each connection has its own NCCL pair, so a
    key never outlives the pairs its graph replays (the graphs of a lost peer are dropped).
    """
    return tuple(sorted((peer, tuple(tokens)) for peer, tokens in stage_tokens.items()))


def ffn_step_mode(flags: Sequence[tuple[bool, bool, bool]], key_captured: bool, may_capture: bool = False) -> tuple[str, str]:
    """(mode, reason) of an FFN step from each plan's (warmup, capture, replay) flags.

    `replay` when every plan says replay and the key is captured; when every plan says
    replay and the key is not captured yet, `capture` if `may_capture` (the set of
    peers in a step changed, e.g. one left: the others keep graph speed), else eager;
    `capture` when every plan says capture; anything else is `eager`, even if a graph
    for the key exists (a plan that says eager is never served from a graph:
    afd-plugin bug #261).
    """
    if flags and all(replay for _, _, replay in flags):
        if key_captured:
            return "replay", ""
        return ("capture", "") if may_capture else ("eager", "no_graph")
    if flags and all(capture for _, capture, _ in flags):
        return "capture", ""
    if flags and all(warmup for warmup, _, _ in flags):
        return "eager", "warmup"
    mixed = any(replay or capture for _, capture, replay in flags)
    return "eager", "mixed_plans" if mixed else "plan_eager"
