"""Decode-step helpers the benchmarks share: a KV cache full of noise, decode graphs over chosen
batches, wall-clock and profiled step timing, an attention link with no FFN behind it.
Children import torch lazily (`afd_decode.py` forks before CUDA)."""

from __future__ import annotations

import statistics
import time


def kv_cache_for(model, max_seqs: int, context: int):
    import torch

    from afd.kv.cache import KVCache

    blocks = max_seqs * (-(-(context + 1) // 16)) + 8
    kv = KVCache(model.kv_layouts(), blocks, torch.bfloat16, "cuda", block_size=16)
    for tensor in (*kv.keys, *kv.values):
        tensor.normal_(0, 1)  # not zeros: timings on zeros flatter
    return kv


def capture_decode_graphs(runner_body, kv, buckets, policy=None, before=None):
    from afd.graphs.decode import DecodeGraphs
    from afd.step.stages import StagePolicy

    graphs = DecodeGraphs(runner_body, kv, tuple(sorted(set(buckets))), policy or StagePolicy(), kv.keys[0].device,
                          before=before)
    graphs.capture_all()
    return graphs


def time_steps(runner, kv, batch: int, steps: int, context: int, vocab: int, warm: int = 3) -> dict:
    """Median wall-clock ms of decode steps of `batch` sequences."""
    import torch

    from afd.step.layout import SeqLayout

    tables = [tuple(kv.allocate(context + 1)) for _ in range(batch)]
    layout = SeqLayout(tuple(tables), (context,) * batch, (1,) * batch)
    ids = torch.randint(0, vocab, (batch,), device="cuda")
    times = []
    for _ in range(steps + warm):
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner(ids, layout).argmax(-1).tolist()
        times.append((time.perf_counter() - start) * 1e3)
    for table in tables:
        kv.release(table)
    kept = times[warm:]
    return {"ms": statistics.median(kept), "min_ms": min(kept), "max_ms": max(kept)}


def profile_steps(runner, kv, batch: int, count: int, context: int, vocab: int) -> list:
    """`count` profiled (eager) steps; their (kind, layer, seconds) lists."""
    import torch

    from afd.metrics.layer_clock import LayerClock, NullClock
    from afd.step.layout import SeqLayout

    tables = [tuple(kv.allocate(context + 1)) for _ in range(batch)]
    layout = SeqLayout(tuple(tables), (context,) * batch, (1,) * batch)
    ids = torch.randint(0, vocab, (batch,), device="cuda")
    got = []
    runner.clock, runner.on_layers = LayerClock("cuda", profile_every=1), got.append
    try:
        for _ in range(count):
            runner(ids, layout).argmax(-1).tolist()
    finally:
        runner.clock, runner.on_layers = NullClock(), None
        for table in tables:
            kv.release(table)
    return got


class NoFFN:
    """An attention link with no FFN behind it: the FFN output is zeros (attention-only step)."""

    def __init__(self):
        self._sent = {}

    def send_plan(self, plan) -> None:
        pass

    def send(self, hidden, transfer, router_logits=None) -> None:
        self._sent[(transfer.layer, transfer.stage)] = hidden

    def recv(self, transfer):
        import torch

        return torch.zeros_like(self._sent.pop((transfer.layer, transfer.stage)))

    def wait_step(self) -> None:
        pass
