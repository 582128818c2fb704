"""NCCL pair smoke test and ping-pong latency on two GPUs: eager, grouped send+recv, captured in a graph.

    NCCL_DEBUG=WARN python3 bench/nccl_smoke.py
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))


def worker(rank: int, queue, threaded: bool) -> None:
    from afd.connector.nccl_lib import Group, PairComm, UniqueId, new_unique_id

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
    for rows in (16, 256, 1024):
        a, b = x[:rows].contiguous(), torch.empty_like(x[:rows])
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            if rank == 0:
                comm.send(a)
                comm.recv(b)
            else:
                comm.recv(b)
                comm.send(a)
        torch.cuda.synchronize()
        if rank == 0:
            print(f"ping-pong {rows}x2048 bf16 ({a.numel() * 2 / 2**10:.0f} KiB): {(time.perf_counter() - start) / 400 * 1e6:.1f} us one way", flush=True)
    comm.close()


if __name__ == "__main__":
    for threaded in (False, True):
        queue = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(worker, args=(queue, threaded), nprocs=2, start_method="spawn")
