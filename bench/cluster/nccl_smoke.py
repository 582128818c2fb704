"""NCCL pair smoke test and ping-pong latency on two GPUs: eager, grouped send+recv, captured in a graph.

    NCCL_DEBUG=WARN python3 bench/cluster/nccl_smoke.py
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)



def worker(rank: int, queue, threaded: bool) -> None:
    from bench.harness.measure import nccl_pingpong

    from afd.connector.transports.nccl.lib import Group, PairComm, UniqueId, new_unique_id

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    if rank == 0:
        uid = new_unique_id()
        queue.put(uid.to_hex())
    else:
        uid = UniqueId.from_hex(queue.get())
    box = {}
    if threaded:
        thread = threading.Thread(target=lambda: box.setdefault("c", PairComm(uid, rank, device)))
        thread.start()
        thread.join()
        comm = box["c"]
    else:
        comm = PairComm(uid, rank, device)
    x = torch.full((1024, 2048), float(rank + 1), dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    with Group():
        comm.send(x)
        comm.recv(y)
    torch.cuda.synchronize()
    print(f"rank {rank} threaded={threaded}: grouped exchange got {y[0, 0].item()}", flush=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with Group():
            comm.send(x)
            comm.recv(y)
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    print(f"rank {rank}: captured exchange got {y[0, 0].item()}", flush=True)
    for rows, one_way_us in nccl_pingpong(comm, rank, (16, 256, 1024), 2048, trips=200, warm=0).items():
        if rank == 0:
            print(f"ping-pong {rows}x2048 bf16 ({rows * 2048 * 2 / 2**10:.0f} KiB): {one_way_us:.1f} us one way", flush=True)
    comm.close()


if __name__ == "__main__":
    for threaded in (False, True):
        queue = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(worker, args=(queue, threaded), nprocs=2, start_method="spawn")
