"""Shared benchmark helpers: device ceilings, CUDA-graph timing, a DeepSeek-V2-Lite-shaped random model."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

# DeepSeek-V2-Lite's config.json dims (https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite)
V2_LITE = dict(
    model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
    n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
    max_position_embeddings=163840, hidden_act="silu",
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
)


# Qwen3-30B-A3B's config.json dims (https://huggingface.co/Qwen/Qwen3-30B-A3B): GQA 32/4 heads of 128, 48 MoE layers
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
    rope_theta=1000000.0, max_position_embeddings=40960, hidden_act="silu", attention_bias=False,
    tie_word_embeddings=False,
)


# The MoE layers of the sample models, as the MoE benchmarks and the tuner take them (`--shape`); Qwen3-30B-A3B's
# config.json dims (https://huggingface.co/Qwen/Qwen3-30B-A3B): 128 experts, top-8, width 768, no shared experts.
MOE_SHAPES = {
    "deepseek-v2-lite": dict(routed=V2_LITE["n_routed_experts"], shared=V2_LITE["n_shared_experts"],
                             top_k=V2_LITE["num_experts_per_tok"], hidden=V2_LITE["hidden_size"],
                             inter=V2_LITE["moe_intermediate_size"], norm_topk_prob=False, fp32_logits=True),
    "qwen3-30b-a3b": dict(routed=128, shared=0, top_k=8, hidden=2048, inter=768, norm_topk_prob=True,
                          fp32_logits=False),  # as afd.models.qwen3_moe builds it: a bf16 router
    # DeepSeek-V3's (https://huggingface.co/deepseek-ai/DeepSeek-V3 config.json): 256 routed + 1 shared, top-8,
    # noaux_tc routing over 8 groups keeping 4, normalized, scaled by 2.5
    "deepseek-v3": dict(routed=256, shared=1, top_k=8, hidden=7168, inter=2048, norm_topk_prob=True,
                        fp32_logits=True, n_group=8, topk_group=4, routed_scaling_factor=2.5),
}


def require_cuda(script: str) -> None:
    """Exit with a message naming `script` (its `__file__`) where torch sees no CUDA GPU: the bench measures nothing
    on a CPU, and a traceback from deep inside it would not say so."""
    if not torch.cuda.is_available():
        raise SystemExit(f"bench/{Path(script).name} needs a CUDA GPU; torch {torch.__version__} sees none here, "
                         "nothing measured")


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


def random_model(config: dict, role: str = "monolithic", gate_on_attention: bool = False, seed: int = 0):
    """A `role`-pruned model with random bf16 weights on the current GPU (shared experts folded in)."""
    from afd.models.loader import build_share, finish_share

    model, spec, crossing = build_share(config, role, gate_on_attention, torch.bfloat16, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0, 0.02, generator=generator)
    finish_share(model, torch.bfloat16, "cuda")
    return model, spec, crossing


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


def write_json(name: str, data) -> None:
    out = Path(os.environ.get("OUT", "."))
    (out / f"{name}.json").write_text(json.dumps(data, indent=2))
