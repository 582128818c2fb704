"""The attention ranks of `afd_decode.py` (GPU 0): attn-0 (monolithic, attention-only, bare ping-pong,
phases A, B, C rank 0, D) and attn-1 (phase C rank 1)."""

from __future__ import annotations

import time

from bench.cluster.afd_decode_phases import afd_config, child_setup
from bench.harness.decode_steps import NoFFN, capture_decode_graphs, kv_cache_for, profile_steps, time_steps
from bench.harness.shapes import v2_lite


def _connect(args, phase, rank, loaded, kv):
    """A handshaken attention role around `loaded` and `kv`; the caller captures the decode graphs it measures."""
    import torch

    from afd.roles.attention import assemble_attention
    from afd.roles.share import Share

    afd = afd_config(args, phase, "attention", rank).replace(cuda_graphs=False)  # the buckets measured, not the defaults
    return assemble_attention(afd, Share(loaded, torch.device("cuda"), "bfloat16"), kv)


def _close(role, q, label):
    """Release the graphs, then close the link for real (Goodbye, then ncclCommDestroy); report its time."""
    import torch

    torch.cuda.synchronize()
    role.runner.graphs = None
    started = time.monotonic()
    role.link.close("benchmark done")
    q.put((f"close_s/{label}", time.monotonic() - started))


def attn0_main(args, q, events) -> None:
    child_setup(0, args.deadline_at)
    import torch
    from bench.harness.measure import nccl_pingpong
    from bench.harness.random_weights import random_model

    from afd.connector.transports.nccl.lib import PairComm, UniqueId
    from afd.models.loader import LoadedModel
    from afd.runners.attention_runner import AttentionRunner, StepOptions
    from afd.step.stages import StagePolicy
    from afd.runners.monolithic_runner import MonolithicRunner

    config = v2_lite(args.layers)
    vocab, top = config["vocab_size"], max(args.batches)

    # monolithic on this GPU, the same kernels, decode graphs over exactly the measured batches
    model, spec, crossing = random_model(config, "monolithic")
    kv = kv_cache_for(model, top, args.context)
    mono = MonolithicRunner(LoadedModel(model, spec, crossing, "random"), kv)
    with torch.inference_mode():
        mono.graphs = capture_decode_graphs(lambda ids, micro: model(ids, micro[0][1], kv), kv, args.batches)
    for batch in args.batches:
        q.put((f"mono/{batch}", time_steps(mono, kv, batch, args.steps, args.context, vocab)))
    q.put(("mono_replays", mono.graphs.replays))
    del mono, model, kv
    torch.cuda.empty_cache()

    # attention share: attention-only step (no FFN behind it), same split and graphs as phase A
    model, spec, crossing = random_model(config, "attention")
    loaded = LoadedModel(model, spec, crossing, "random")
    kv = kv_cache_for(model, top, args.context)
    for stages in (2, 1):
        solo = AttentionRunner(loaded, NoFFN(), kv, StepOptions(StagePolicy(stages)))
        solo.capture_graphs(buckets=args.batches)
        for batch in args.batches:
            q.put((f"attn_only/s{stages}/{batch}", time_steps(solo, kv, batch, args.steps, args.context, vocab)))
        solo.graphs = None
    torch.cuda.empty_cache()

    # bare NCCL ping-pong with the FFN rank (attention is pair rank 1)
    if not events["uid"].wait(max(1.0, args.deadline_at - time.time())):
        raise TimeoutError("no NCCL id from the ffn rank")
    uid = args_uid_from_queue(events)
    comm = PairComm(UniqueId.from_hex(uid), 1, torch.device("cuda"))
    q.put(("bare_attn_side", nccl_pingpong(comm, 1, args.rows, spec.hidden_size)))
    torch.cuda.synchronize()
    comm.close()

    for phase in ("A", "B"):
        _single_rank_phase(args, q, events, phase, loaded, kv, vocab)
    _phase_c(args, q, events, 0, loaded, kv)
    _single_rank_phase(args, q, events, "D", loaded, kv, vocab)


def _single_rank_phase(args, q, events, phase, loaded, kv, vocab) -> None:
    """1A1F: capture, time and profile every batch, then close the link."""
    events[f"serving/{phase}"].wait(max(1.0, args.deadline_at - time.time()))
    role = _connect(args, phase, 0, loaded, kv)
    runner = role.runner
    graphs = runner.capture_graphs(buckets=args.batches)
    q.put((f"afd_graph_mib/{phase}", graphs.memory_bytes / 2**20))
    for batch in args.batches:
        q.put((f"afd/{phase}/{batch}", time_steps(runner, kv, batch, args.steps, args.context, vocab)))
        q.put((f"profile/{phase}/{batch}", profile_steps(runner, kv, batch, args.profile_steps, args.context, vocab)))
    q.put((f"attn_phase/{phase}/0", {"replays": graphs.replays, "eager_steps": runner.eager_steps,
                                     "profiled_eager": runner.profiled_eager_steps}))
    del graphs  # ncclCommDestroy waits until every graph holding the pair's transfers is gone
    _close(role, q, f"{phase}/0")
    events[f"done/{phase}/0"].set()


def args_uid_from_queue(events) -> str:
    return events["uid_box"].get(timeout=30)


def _rank_share(batch: int, rank: int) -> int:
    """Sequences of a total `batch` on attention rank `rank` of two (contiguous blocks, as `afd.config.topology`)."""
    return (batch + 1) // 2 if rank == 0 else batch // 2


def _phase_c(args, q, events, rank, loaded, kv) -> None:
    vocab = v2_lite(args.layers)["vocab_size"]
    shares = [_rank_share(batch, rank) for batch in args.batches]  # rank 0 takes the odd sequence
    events["serving/C"].wait(max(1.0, args.deadline_at - time.time()))
    role = _connect(args, "C", rank, loaded, kv)
    runner = role.runner
    barrier = events["barrier"]
    barrier.wait(timeout=120)
    graphs = runner.capture_graphs(buckets=[share for share in shares if share] or [1])
    for batch, share in zip(args.batches, shares):
        barrier.wait(timeout=120)
        if share:  # a rank with no sequence of a batch of 1 has no step to time
            q.put((f"afd/C/{batch}/{rank}", time_steps(runner, kv, share, args.steps, args.context, vocab)))
    q.put((f"attn_phase/C/{rank}", {"replays": graphs.replays, "eager_steps": runner.eager_steps}))
    barrier.wait(timeout=120)
    del graphs  # ncclCommDestroy waits until every graph holding the pair's transfers is gone
    _close(role, q, f"C/{rank}")
    events[f"done/C/{rank}"].set()


def attn1_main(args, q, events) -> None:
    child_setup(0, args.deadline_at)
    import torch  # noqa: F401
    from bench.harness.random_weights import random_model

    from afd.models.loader import LoadedModel

    config = v2_lite(args.layers)
    model, spec, crossing = random_model(config, "attention", seed=1)
    kv = kv_cache_for(model, max(args.batches) // 2, args.context)
    events["serving/C"].wait(max(1.0, args.deadline_at - time.time()))
    _phase_c(args, q, events, 1, LoadedModel(model, spec, crossing, "random"), kv)
