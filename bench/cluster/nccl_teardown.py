"""How long an NCCL pair's teardown takes, and on what it waits (issue 20: close_s was 5.0 s every time).

Two processes, one GPU each, one `PairComm` per case, the teardown timed with a 60 s cap:

  destroy_both        both ends call ncclCommDestroy together, nothing captured
  destroy_alone       one end destroys while the other waits 8 s before its own destroy
  destroy_graph_alive both destroy while a CUDA graph holding the pair's transfers is still alive
  destroy_graph_freed the graph is deleted (and the device synced) before both destroy
  abort_idle          both ends call ncclCommAbort, nothing in flight
  abort_peer_dead     end 1 exits (os._exit) after the pair was used; end 0 then aborts
  abort_stuck         end 0 posts a receive the dead peer never answers, then aborts on another thread;
                      reports the abort time and how long until the stream drained

    NCCL_DEBUG=WARN python3 bench/cluster/nccl_teardown.py
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

CAP_S = 20.0
CASES = ("destroy_both", "destroy_alone", "destroy_graph_alive", "destroy_graph_freed", "abort_idle", "abort_peer_dead")


def _timed(fn, comm_handle) -> float:
    """Seconds `fn(handle)` took on a helper thread (as the runtime calls it), capped at CAP_S."""
    thread = threading.Thread(target=fn, args=(comm_handle,), daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(CAP_S)
    return round(time.monotonic() - started, 3) if not thread.is_alive() else float("inf")


def worker(rank: int, queues, barrier, results) -> None:
    from afd.connector.transports.nccl.lib import Group, PairComm, UniqueId, library, new_unique_id

    device = _device(rank)
    lib = library().lib
    x = torch.ones(4096, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)

    def pair() -> PairComm:
        if rank == 0:
            uid = new_unique_id()
            queues[1].put(uid.to_hex())
        else:
            uid = UniqueId.from_hex(queues[1].get())
        comm = PairComm(uid, rank, device)
        with Group():
            comm.send(x)
            comm.recv(y)
        torch.cuda.synchronize()
        return comm

    for case in CASES:
        barrier.wait()
        comm = pair()
        handle = comm.detach()  # the raw ncclComm_t, torn down by hand below
        graph = None
        if case.startswith("destroy_graph"):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                with Group():
                    lib.ncclSend(x.data_ptr(), x.numel(), 1, 1 - rank, handle, torch.cuda.current_stream().cuda_stream)
                    lib.ncclRecv(y.data_ptr(), y.numel(), 1, 1 - rank, handle, torch.cuda.current_stream().cuda_stream)
            graph.replay()
            torch.cuda.synchronize()
            if case == "destroy_graph_freed":
                del graph
                graph = None
                torch.cuda.synchronize()
        barrier.wait()
        if case == "abort_peer_dead":
            if rank == 1:
                os._exit(0)
            time.sleep(1.0)
            results.put((case, rank, _timed(lib.ncclCommAbort, handle)))
            stuck(lib, device, queues, results)
            return
        if case == "destroy_alone" and rank == 1:
            time.sleep(8.0)
        teardown = lib.ncclCommAbort if case.startswith("abort") else lib.ncclCommDestroy
        results.put((case, rank, _timed(teardown, handle)))
        del graph


def stuck(lib, device, queues, results) -> None:
    """End 0 alone: a pair whose other end never joins cannot be built, so reuse a fresh pair with a dead peer:
    post a receive on a communicator whose peer is gone, abort it, time the abort and the stream's drain."""
    from afd.connector.transports.nccl.lib import PairComm, new_unique_id

    helper = mp.get_context("spawn").Process(target=_short_lived_peer, args=(queues[0],))
    helper.start()
    uid = new_unique_id()
    queues[0].put(uid.to_hex())
    comm = PairComm(uid, 0, device)
    helper.join(30)  # the peer has exited now
    out = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    comm.recv(out)  # never answered
    event = torch.cuda.Event()
    event.record()
    time.sleep(0.5)
    handle = comm.detach()
    started = time.monotonic()
    thread = threading.Thread(target=lib.ncclCommAbort, args=(handle,), daemon=True)
    thread.start()
    while not event.query() and time.monotonic() - started < CAP_S:
        time.sleep(0.001)
    drained = round(time.monotonic() - started, 3) if event.query() else float("inf")
    thread.join(CAP_S)
    results.put(("abort_stuck", 0, {"stream_drained_s": drained, "abort_returned_s":
                                    round(time.monotonic() - started, 3) if not thread.is_alive() else float("inf")}))


def _device(rank: int, name: str = "") -> torch.device:
    """GPU `rank`; with one GPU, GPU 0 for both ends, each process its own NCCL host (socket transport)."""
    if torch.cuda.device_count() > 1:
        index = rank
    else:
        index = 0
        os.environ["NCCL_HOSTID"] = f"teardown-{rank}{name}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _short_lived_peer(queue) -> None:
    from afd.connector.transports.nccl.lib import PairComm, UniqueId

    PairComm(UniqueId.from_hex(queue.get()), 1, _device(1, "peer"))
    os._exit(0)


def main() -> None:
    from afd.connector.transports.nccl import lib as nccl_lib

    context = mp.get_context("spawn")
    queues = [context.Queue(), context.Queue()]
    barrier, results = context.Barrier(2), context.Queue()
    workers = [context.Process(target=worker, args=(rank, queues, barrier, results)) for rank in (0, 1)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(600)
    table = {}
    while not results.empty():
        case, rank, seconds = results.get()
        table.setdefault(case, {})[f"end{rank}"] = seconds
    transport = "p2p between two GPUs" if torch.cuda.device_count() > 1 else "sockets on one GPU (NCCL_HOSTID per process)"
    print(json.dumps({"nccl": nccl_lib.version(), "transport": transport, "teardown_s": table}, indent=1))


if __name__ == "__main__":
    main()
