"""What the benchmarks measure with: CUDA-graph and event timing, device ceilings, kernel counts, a bare NCCL
ping-pong, percentiles, and the JSON written under $OUT."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def require_cuda(script: str) -> None:
    """Exit with a message naming `script` (its `__file__`) where torch sees no CUDA GPU: the bench measures nothing
    on a CPU, and a traceback from deep inside it would not say so."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{Path(script).resolve().relative_to(REPO)} needs a CUDA GPU; torch {torch.__version__} sees "
                         "none here, nothing measured")


def time_graph(fn, iters: int = 50) -> float:
    """Median ms of `fn` replayed in a CUDA graph (after warm-up), timed with events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_callable(graph.replay, iters)


def time_callable(fn, iters: int = 50) -> float:
    """Median ms of `fn` over `iters` runs, each bracketed by CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ceilings() -> dict:
    """Measured copy bandwidth (bytes read + written per second) and bf16 matmul rate (FLOP/s)."""
    src = torch.randn(2**30 // 2, dtype=torch.bfloat16, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = time_callable(lambda: dst.copy_(src), 20)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = time_callable(lambda: a @ b, 20)
    return {"copy_bytes_per_s": 2 * src.numel() * 2 / (copy_ms / 1e3), "bf16_flops": 2 * 8192**3 / (mm_ms / 1e3)}


def nccl_pingpong(comm, rank: int, rows_list, hidden: int, trips: int = 100, warm: int = 10) -> dict:
    """One-way µs of a bare NCCL send/recv ping-pong of rows x hidden bf16 per row count (host loop, one sync)."""
    out = {}
    for rows in rows_list:
        a = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
        b = torch.empty_like(a)
        for n, record in ((warm, False), (trips, True)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(n):
                if rank == 0:
                    comm.send(a)
                    comm.recv(b)
                else:
                    comm.recv(b)
                    comm.send(a)
            torch.cuda.synchronize()
            if record:
                out[rows] = (time.perf_counter() - start) / (2 * n) * 1e6
    return out


def count_kernels(run) -> dict:
    """Device activities of `run()` from the profiler: kernels, copies and sets, and the kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names: dict[str, int] = {}
    micros: dict[str, float] = {}
    copies = 0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if event.name.startswith(("Memcpy", "Memset")):
            copies += 1
        else:
            names[event.name] = names.get(event.name, 0) + 1
            micros[event.name] = micros.get(event.name, 0.0) + event.time_range.elapsed_us()
    return {"kernels": sum(names.values()), "copies": copies, "by_name": names, "us_by_name": micros}


def print_kernel_times(run, label: str, top: int = 8) -> dict:
    """Profile one `run()` (after it has run once: nothing compiles inside) and print its `top` kernels by summed
    device time, µs and share; returns {kernel name: µs}."""
    run()
    micros = count_kernels(run)["us_by_name"]
    total = sum(micros.values()) or 1.0
    print(f"      {label}: {total:.0f} µs of kernels", flush=True)
    for name, us in sorted(micros.items(), key=lambda item: -item[1])[:top]:
        print(f"        {us:>8.1f} µs {100 * us / total:>5.1f} %  {name[:90]}", flush=True)
    return micros


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def write_json(name: str, data) -> None:
    out = Path(os.environ.get("OUT", "."))
    (out / f"{name}.json").write_text(json.dumps(data, indent=2))
