"""Expert-parallel dispatch and combine on NCCL: time per layer against a bare exchange of the same bytes.

    NCCL_DEBUG=WARN python3 bench/cluster/ep_exchange.py [--shards 2] [--hidden 2048] [--rows 16,64,256,1024] [--layers 26]

Process 0 is an attention rank on GPU 0 running the real `ShardedLink` over one `NcclAttentionPlane`
per shard (every shard gets all bf16 rows; the float32 partial outputs are summed). Processes
1..G are FFN shards that send each layer's rows back as float32 partials with the FFN plane's
send-with-the-next-receive grouping (no compute: only the exchange is timed). Shard s runs on GPU s when there are more than G GPUs,
else every shard shares GPU 1 (NCCL refuses two ranks of one pair on one GPU, so no shard can
share GPU 0 with attention). The bare baseline moves the same bytes in one exchange with shard 0
only: [G·rows, hidden] bf16 out, float32 back. Printed per row count: µs per layer for the EP exchange
(eager and replayed in a CUDA graph) and for the bare exchange (graph), and their ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)



def shard_gpu(shard: int, shards: int) -> int:
    return 1 + shard if torch.cuda.device_count() > shards else 1


def echo(comm, rows: int, hidden: int, layers: int, steps: int, device) -> None:
    """The FFN side of `steps` steps: receive each layer's bf16 rows, send them back as float32 partials
    with the next receive."""
    from afd.connector.transports.nccl.lib import Group

    bufs = [torch.empty(rows, hidden, dtype=torch.bfloat16, device=device) for _ in range(2)]
    for _ in range(steps):
        pending = None
        for layer in range(layers):
            with Group():
                if pending is not None:
                    comm.send(pending)
                comm.recv(bufs[layer % 2])
            pending = bufs[layer % 2].float()
        with Group():
            comm.send(pending)
    torch.cuda.synchronize(device)


def shard_main(shard: int, args, uid_hex: str, barrier, plan) -> None:
    from afd.connector.transports.nccl.lib import PairComm, UniqueId

    device = torch.device("cuda", shard_gpu(shard, args.shards))
    torch.cuda.set_device(device)
    comm = PairComm(UniqueId.from_hex(uid_hex), 0, device)  # the FFN end is rank 0 of a pair
    for rows, steps in plan:
        barrier.wait()
        echo(comm, rows, args.hidden, args.layers, steps, device)  # EP, eager
        barrier.wait()
        echo(comm, rows, args.hidden, args.layers, steps, device)  # EP, graph replays
        barrier.wait()
        if shard == 0:  # the bare exchange: G·rows with one peer
            echo(comm, rows * args.shards, args.hidden, args.layers, steps, device)
        barrier.wait()
    comm.close()


def attention_main(args, uids: list[str], barrier, plan) -> None:
    from afd.connector.attention_link import AttentionLink, LinkOptions
    from afd.connector.base import AttnTransfer
    from afd.connector.expert_link import ShardedLink
    from afd.connector.transports.nccl.attention import NcclAttentionPlane
    from afd.connector.transports.nccl.lib import Group, PairComm, UniqueId
    from afd.connector.plane import PlaneOptions

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    links = []
    for uid in uids:
        plane = NcclAttentionPlane(PlaneOptions(device, 60.0))
        plane.comm = PairComm(UniqueId.from_hex(uid), 1, device)
        links.append(AttentionLink(0, lambda: _NoTransport(), plane, LinkOptions()))
    link = ShardedLink(links)

    def ep_step(x, step=[0]):  # noqa: B006 (a step counter)
        step[0] += 1
        out = x
        for layer in range(args.layers):
            transfer = AttnTransfer(step[0], layer, 0)
            link.send(out, transfer)
            out = (link.recv(transfer) / args.shards).to(x.dtype)  # the echoes sum to G·x: scale back
        return out

    print(f"shards={args.shards} (GPUs {[shard_gpu(s, args.shards) for s in range(args.shards)]}), hidden={args.hidden}, "
          f"layers={args.layers}, bf16", flush=True)
    print(f"{'rows':>6} {'KiB out':>10} {'EP eager us':>12} {'EP graph us':>12} {'bare us':>9} {'EP/bare':>8}", flush=True)
    for rows, steps in plan:
        x = torch.full((rows, args.hidden), 1.0, dtype=torch.bfloat16, device=device)
        barrier.wait()
        eager = _per_layer(lambda: ep_step(x), steps, args.layers)
        barrier.wait()
        graph = torch.cuda.CUDAGraph()
        ep_step(x)  # warm-up (allocations); capturing records the next step, its replays are the rest
        with torch.cuda.graph(graph):
            y = ep_step(x)
        graphed = _per_layer(graph.replay, steps - 1, args.layers)
        assert torch.equal(y, x), "the combined output differs from what was sent"
        barrier.wait()
        big, big_out = (torch.ones(rows * args.shards, args.hidden, dtype=torch.bfloat16, device=device),
                        torch.empty(rows * args.shards, args.hidden, dtype=torch.float32, device=device))
        comm = links[0].plane.comm

        def bare_step():
            for _ in range(args.layers):
                with Group():
                    comm.send(big)
                    comm.recv(big_out)

        bare = _per_layer(bare_step, steps, args.layers)
        barrier.wait()
        kib = rows * args.hidden * 2 / 2**10
        print(f"{rows:>6} {kib:>10.0f} {eager:>12.1f} {graphed:>12.1f} {bare:>9.1f} {graphed / bare:>8.2f}", flush=True)
    for one in links:
        one.plane.close()


def _per_layer(run, steps: int, layers: int) -> float:
    """µs per layer over `steps` runs of `run` (each one step of `layers` layers), timed with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (steps * layers)


class _NoTransport:
    """The control plane is not used: the bench drives the data planes directly."""

    identity = b"bench"

    def send(self, plane, frames) -> None:
        pass

    def close(self) -> None:
        pass


def main_process(rank: int, args, uids, barrier, plan) -> None:
    if rank == 0:
        attention_main(args, uids, barrier, plan)
    else:
        shard_main(rank - 1, args, uids[rank - 1], barrier, plan)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048, help="2048: DeepSeek-V2-Lite; 7168: DeepSeek-V3")
    parser.add_argument("--rows", default="16,64,256,1024")
    parser.add_argument("--layers", type=int, default=26, help="crossing layers per step")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs two GPUs", file=sys.stderr)
        return 1
    from afd.connector.transports.nccl.lib import new_unique_id

    uids = [new_unique_id().to_hex() for _ in range(args.shards)]
    # per row count: the eager phase runs `steps` steps; the graph phase one eager step, then steps - 1 replays
    plan = [(int(rows), args.steps) for rows in args.rows.split(",")]
    barrier = mp.get_context("spawn").Barrier(args.shards + 1)
    mp.start_processes(main_process, args=(args, uids, barrier, plan), nprocs=args.shards + 1, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
