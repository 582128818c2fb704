"""The step ceiling: how fast this rank's own decode step runs, timed at start before serving.

For each batch size of `ceiling_batches`, steps of that many decoding sequences (each with
`ceiling_context` cached tokens, in real KV-cache blocks filled with noise, and its own random
input token) run through the rank's stepper,
graph-replayed where graphs are captured; the median wall time around step + argmax + host
copy (what a serving loop sees at best) is logged and exported as
`afd_step_ceiling_seconds{batch}`. batch ÷ that time is the most decode tokens/s the rank can
serve; the serving benchmark divides what it gets by it. Rows must differ as served rows do: a
batch of one repeated token on an empty cache routes every row to the same few experts, reads a
fraction of the expert weights, and on a DeepSeek-V2-Lite-shaped model timed 8.6 ms at 16
sequences against 12.7 ms for real traffic (bench/RESULTS.md, eighth session).
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
from prometheus_client import CollectorRegistry, Gauge

from afd.config import GraphSettings, GroupSettings, SchedulerSettings
from afd.models.kv_dtype import store_rows
from afd.step.layout import SeqLayout

log = logging.getLogger(__name__)
CEILING_CONTEXT = 704  # the serving benchmark's mean context: prompts of 128-1024 tokens, half of 256 outputs
CEILING_STEPS = 20


@torch.inference_mode()
def step_seconds(step, kv_cache, batch: int, context: int = CEILING_CONTEXT, steps: int = CEILING_STEPS,
                 link=None, *, vocab_size: int) -> float:
    """Median seconds of one decode step of `batch` sequences with `context` cached tokens each, their input
    tokens drawn from the model's `vocab_size` (on AFD each step is waited for on `link`, which notices a lost
    FFN, before its tokens are read)."""
    blocks = [kv_cache.allocate(context + 1) for _ in range(batch)]
    try:
        fill_with_noise(kv_cache, [b for table in blocks for b in table])
        layout = SeqLayout(tuple(map(tuple, blocks)), (context,) * batch, (1,) * batch)
        generator = torch.Generator().manual_seed(batch)
        input_ids = torch.randint(0, vocab_size, (batch,), generator=generator).to(kv_cache.keys[0].device)
        times = []
        for _ in range(steps + 3):
            started = time.perf_counter()
            logits = step(input_ids, layout)
            if link is not None:
                link.wait_step()
            logits.argmax(dim=-1).tolist()
            times.append(time.perf_counter() - started)
        return statistics.median(times[3:])
    finally:
        for table in blocks:
            kv_cache.release(table)


def fill_with_noise(kv_cache, blocks: list[int]) -> None:
    """Unit-variance noise in the keys and values of `blocks` (timings on an empty cache flatter)."""
    size = kv_cache.block_size
    rows = (torch.tensor(blocks).unsqueeze(1) * size + torch.arange(size)).flatten().to(kv_cache.keys[0].device)
    for tensor in kv_cache.tensors():  # drawn in float32, stored as the cache stores (FP8: quantized)
        store_rows(tensor, rows, torch.randn((len(rows), *tensor.shape[1:]), device=tensor.device))


def export_ceiling(registry: CollectorRegistry, group: GroupSettings, graphs: GraphSettings,
                   scheduler: SchedulerSettings, role) -> dict[int, float]:
    """Time every batch of `graphs.ceiling_batches` that fits; log and export them."""
    gauge = Gauge("afd_step_ceiling_seconds", "Graph-replayed decode step time measured at start, per batch size",
                  ["role", "rank", "batch"], registry=registry)
    kv_cache, results = role.kv_cache, {}
    context = graphs.ceiling_context
    for batch in sorted({int(b) for b in graphs.ceiling_batches.split(",") if b.strip()}):
        if batch > scheduler.max_num_seqs or kv_cache.blocks_for(context + 1) * batch > kv_cache.free_blocks:
            log.warning("step ceiling at batch %d skipped: above max_num_seqs or the KV cache", batch)
            continue
        results[batch] = seconds = step_seconds(role.runner, kv_cache, batch, context, link=role.link,
                                                vocab_size=role.loaded.spec.vocab_size)
        gauge.labels(role=group.role, rank=str(group.rank), batch=str(batch)).set(seconds)
        log.info("step ceiling at batch %d, context %d: %.2f ms per step, %.0f tokens/s", batch, context, 1e3 * seconds,
                 batch / seconds)
    return results
