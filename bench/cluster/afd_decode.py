"""(b) AFD decode vs monolithic, (c) per-layer transfer latency in a step vs bare NCCL, (e) 2A1F vs 1A1F;
and the DBO threshold (phase D). Tables: `afd_decode_report.py`.

    NCCL_DEBUG=WARN python3 bench/cluster/afd_decode.py [--layers 27] [--batches 32,128,512] [--deadline 420]

Needs two GPUs. DeepSeek-V2-Lite-shaped random bf16 model (`--layers` of them, first dense),
gate on the FFN, nccl connector, CUDA graphs on both sides, one process per rank:

  ffn     GPU 1: FFN-only step times (the step's crossing layers x stages replayed in a CUDA
          graph), then a bare NCCL ping-pong with attn-0, then it serves phases A, B, C, D.
  attn-0  GPU 0: the monolithic model (same kernels, decode graphs) step times; the attention-
          only step (the same AttentionRunner and graphs, its connector replaced by one that
          returns zeros); the bare ping-pong; then phase A (1A1F, stages=2 = DBO), phase B
          (1A1F, stages=1, for the profiled transfer split), phase C (2A1F, rank 0) and
          phase D (1A1F, stages=2 with dbo_min_tokens=192: one micro-batch below 192 tokens).
  attn-1  GPU 0: phase C, rank 1.

Step times are wall clock around `runner(ids, layout).argmax(-1).tolist()` (what a serving loop
sees), median of --steps, except the FFN-only step (CUDA events around graph replays). Every
sequence has --context cached tokens. Per-layer transfer (c): in profiled steps of phase B the
attention side's "recv" interval of crossing layer L spans send(hidden) + FFN compute(L) +
send(output); the FFN's "compute" interval of the same step and layer is subtracted and the rest
halved: one-way in-step transfer. Prints a table, writes $OUT/afd_decode.json.
Every child has a deadline (faulthandler dumps its stacks, then it exits); the parent kills
every child that is left when the deadline passes or as soon as one fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.cluster.afd_decode_phases import PHASES, afd_config, child_setup, split_rows  # noqa: E402
from bench.cluster.afd_decode_report import report  # noqa: E402

# ---------------------------------------------------------------- FFN rank (GPU 1)
def ffn_main(args, q, events) -> None:
    child_setup(1, args.deadline_at)
    import threading

    import torch
    from bench.harness.measure import nccl_pingpong, time_graph
    from bench.harness.random_weights import random_model
    from bench.harness.shapes import v2_lite

    from afd.connector.transports.nccl.lib import PairComm, new_unique_id
    from afd.metrics.layer_clock import LayerClock, StepInstruments
    from afd.models.loader import LoadedModel
    from afd.roles.ffn import assemble_ffn
    from afd.roles.share import Share

    config = v2_lite(args.layers)
    model, spec, crossing = random_model(config, "ffn")
    loaded = LoadedModel(model, spec, crossing, "random")
    from afd.models.moe_prep import warm_up

    warm_up(model)  # as build_ffn does: every tuned MoE kernel compiled and loaded before any transfer
    q.put(("log", f"ffn: model ready, {len(crossing)} crossing layers, {torch.cuda.memory_allocated() / 2**30:.1f} GiB"))

    # FFN-only step: every crossing layer x stage, graph-replayed, no transfers
    with torch.inference_mode():
        for stages in (2, 1):
            for batch in args.batches:
                xs = [torch.randn(rows, spec.hidden_size, dtype=torch.bfloat16, device="cuda") for rows in split_rows(batch, stages)]

                def body(xs=xs):
                    for layer in crossing:
                        for x in xs:
                            model.layers[layer].ffn_half(x)

                q.put((f"ffn_only/s{stages}/{batch}", time_graph(body, 30)))
    torch.cuda.empty_cache()

    # bare NCCL ping-pong with attn-0 (FFN is pair rank 0)
    uid = new_unique_id()
    q.put(("uid", uid.to_hex()))
    events["uid"].set()
    comm = PairComm(uid, 0, torch.device("cuda"))
    q.put(("bare_ffn_side", nccl_pingpong(comm, 0, args.rows, spec.hidden_size)))
    torch.cuda.synchronize()
    comm.close()

    for phase in PHASES:
        profiles = []
        worker = assemble_ffn(afd_config(args, phase, "ffn", 0), Share(loaded, torch.device("cuda"), "bfloat16"),
                              StepInstruments(LayerClock("cuda", profile_every=1), profiles.append))
        executor = worker.executor
        stop = threading.Event()
        ranks = PHASES[phase][0]

        def watch(phase=phase, ranks=ranks, stop=stop):
            while not all(events[f"done/{phase}/{r}"].is_set() for r in range(ranks)):
                if time.time() > args.deadline_at:
                    break
                time.sleep(0.05)
            stop.set()

        threading.Thread(target=watch, daemon=True).start()
        events[f"serving/{phase}"].set()
        graphs = executor.graphs
        worker.serve(stop)
        q.put((f"ffn_phase/{phase}", {
            "steps": worker.steps_run, "replays": graphs.replays, "eager": dict(graphs.eager_steps),
            "graph_mib": graphs.memory_bytes / 2**20, "profiles": profiles,
        }))
    q.put(("log", "ffn: done"))


def _child(target, args, q, events, name):
    code = 0
    try:
        target(args, q, events)
    except BaseException:
        q.put(("error", f"{name}: {traceback.format_exc()}"))
        code = 1
    q.close()
    q.join_thread()  # what was put reaches the parent before the hard exit below
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no atexit/NCCL teardown that could hang


# ---------------------------------------------------------------- report
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--batches", default="32,128,512")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds until every child is killed")
    args = parser.parse_args()
    from bench.harness.measure import require_cuda

    require_cuda(__file__)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.rows = sorted(set(args.batches))
    args.deadline_at = time.time() + args.deadline
    from afd.local.children import free_port_block

    args.ports = {phase: free_port_block(2) + 0 for phase in PHASES}
    if len(set(args.ports.values())) < len(PHASES):
        args.ports = {phase: port + 2 * i for i, (phase, port) in enumerate(args.ports.items())}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    events = {"uid": ctx.Event(), "uid_box": ctx.Queue(), "barrier": ctx.Barrier(2)}
    for phase, (ranks, *_) in PHASES.items():
        events[f"serving/{phase}"] = ctx.Event()
        for rank in range(ranks):
            events[f"done/{phase}/{rank}"] = ctx.Event()
    from bench.cluster.afd_decode_attention import attn0_main, attn1_main

    procs = {name: ctx.Process(target=_child, args=(fn, args, q, events, name), name=name, daemon=True)
             for name, fn in (("ffn", ffn_main), ("attn-0", attn0_main), ("attn-1", attn1_main))}
    for p in procs.values():
        p.start()
    results, errors, started = {}, [], time.time()
    try:
        while time.time() < args.deadline_at:
            try:
                key, value = q.get(timeout=0.5)
            except queue_mod.Empty:
                key = None
            if key == "uid":
                events["uid_box"].put(value)
            elif key == "log":
                print(f"[{time.time() - started:6.1f}s] {value}", flush=True)
            elif key == "error":
                errors.append(value)
                print(f"[{time.time() - started:6.1f}s] ERROR {value}", flush=True)
                break
            elif key is not None:
                results[key] = value
                if not key.startswith(("profile", "ffn_phase")):
                    print(f"[{time.time() - started:6.1f}s] {key}: {value}", flush=True)
            if key is None and not any(p.is_alive() for p in procs.values()):
                break
        else:
            errors.append(f"deadline of {args.deadline:.0f} s passed")
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        for p in procs.values():
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        while True:  # what the children sent before they ended
            try:
                key, value = q.get_nowait()
            except (queue_mod.Empty, OSError, EOFError):
                break
            if key not in ("log", "uid", "error"):
                results[key] = value
    summary = report(args, results)
    summary["errors"] = errors
    summary["exit_codes"] = {name: p.exitcode for name, p in procs.items()}
    out = Path(os.environ.get("OUT", "."))
    (out / "afd_decode.json").write_text(json.dumps(summary, indent=2, default=str))
    print("exit codes:", summary["exit_codes"], "errors:", len(errors), f"wall {time.time() - started:.0f} s")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
