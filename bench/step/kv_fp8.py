"""The FP8 KV cache (`kv_cache_dtype=fp8`) against the model-dtype cache: the decode step's time, and greedy agreement.

    python3 bench/step/kv_fp8.py step [--batch 256] [--context 2048] [--layers 0] [--steps 20]      # GPU
    python3 bench/step/kv_fp8.py agreement --shape deepseek-v3 [--layers 4] [--experts 16]         # GPU
    python3 bench/step/kv_fp8.py agreement --tiny deepseek_v2,deepseek_v3,qwen3_moe,glm4_moe       # CPU

`step`: the monolith's decode step at DeepSeek-V2-Lite shape (random bf16 weights, `--layers 0`: all 27), CUDA
graphs, every sequence with `context` cached tokens, once over a bf16 cache and once over an FP8 one: `gpu_ms` of the
graph's replay each, and `fp8 / bf16` (issue 54's goal: at most 0.9 at 256 × 2,048). `agreement`: 16 prompts × 32
greedy tokens with each cache; per prompt the first generated token where the FP8 cache's run differs (none: all 32
agree), and teacher-forced logits (both caches fed the bf16 run's tokens): the median and largest
max|Δlogit| / max|logit| per step, and how often the top token agrees. `--shape deepseek-v3`: DeepSeek-V3's
attention (128 heads, q LoRA 1536, latent 512 + rotary 64, YaRN) with `--layers` layers and `--experts` routed
experts (random weights; the MoE cut to fit one GPU), or `--tiny`: the tests' tiny checkpoints in float32 and bf16.
Writes $OUT/kv_fp8_<mode>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import require_cuda, write_json  # noqa: E402

PROMPTS, NEW_TOKENS = 16, 32
V3_CONFIG = REPO / "docs/models/DeepSeek-V3.config.json"


def agreement_prompts(vocab: int, count: int = PROMPTS, seed: int = 0) -> list[list[int]]:
    """`count` prompts of 2 to 19 random token ids below min(vocab, 200)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 20, (count,), generator=generator).tolist()
    return [torch.randint(1, min(vocab, 200), (n,), generator=generator).tolist() for n in lengths]


def first_differences(reference: list[list[int]], other: list[list[int]]) -> list[int | None]:
    """Per prompt, the index of the first generated token where `other` differs from `reference` (None: never)."""
    return [next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None) for ref, got in zip(reference, other)]


@torch.inference_mode()
def forced_logits(loaded, cache_dtype: torch.dtype, prompts, tokens, device) -> torch.Tensor:
    """[prompts, steps, vocab] float32 logits of every step when each prompt is followed by `tokens` (its own row),
    over a fresh cache of `cache_dtype`: the prompts in one step, then one forced token a step."""
    from afd.kv.cache import KVCache
    from afd.runners.monolithic_runner import MonolithicRunner
    from afd.step.layout import SeqLayout

    steps = len(tokens[0])
    cache = KVCache.for_tokens(loaded.model.kv_layouts(), sum(len(p) + steps + 16 for p in prompts), cache_dtype,
                               device)
    runner = MonolithicRunner(loaded, cache)
    tables = tuple(tuple(cache.allocate(len(p) + steps)) for p in prompts)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    out = [runner(ids, SeqLayout(tables, (0,) * len(prompts), tuple(len(p) for p in prompts))).float()]
    for j in range(steps - 1):
        ids = torch.tensor([row[j] for row in tokens], device=device)
        out.append(runner(ids, SeqLayout(tables, tuple(len(p) + j for p in prompts), (1,) * len(prompts))).float())
    return torch.stack(out, 1)


def logit_drift(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Per step max|Δlogit| / max|logit| of `other` against `reference` ([prompts, steps, vocab]): its median and
    largest, and the share of steps whose top token agrees."""
    drift = (other - reference).abs().amax(-1) / reference.abs().amax(-1)
    return {"median_drift": float(drift.median()), "max_drift": float(drift.max()),
            "top1_agreement": float((other.argmax(-1) == reference.argmax(-1)).float().mean())}


def agreement(loaded, model_dtype: torch.dtype, device, prompts, new_tokens: int = NEW_TOKENS) -> dict:
    """Greedy runs over a `model_dtype` cache and an FP8 one; `first_differences` and the forced `logit_drift`."""
    from afd.engine.generation import greedy_generate
    from afd.kv.cache import KVCache
    from afd.models.kv_dtype import FP8
    from afd.runners.monolithic_runner import MonolithicRunner

    runs = {}
    for dtype in (model_dtype, FP8):
        cache = KVCache.for_tokens(loaded.model.kv_layouts(), sum(len(p) + new_tokens + 16 for p in prompts), dtype,
                                   device)
        runs[dtype] = greedy_generate(MonolithicRunner(loaded, cache), cache, prompts, new_tokens, ignore_eos=True,
                                      device=device).tokens
    firsts = first_differences(runs[model_dtype], runs[FP8])
    reference = forced_logits(loaded, model_dtype, prompts, runs[model_dtype], device)
    drift = logit_drift(reference, forced_logits(loaded, FP8, prompts, runs[model_dtype], device))
    return {"first_differing_token": firsts, "identical_prompts": sum(f is None for f in firsts),
            "prompts": len(prompts), "tokens": new_tokens, **drift}


def v3_shaped(layers: int, experts: int) -> dict:
    """DeepSeek-V3's config.json with `layers` layers (the first dense, as many as V3 has dense up to 3) and
    `experts` routed experts in bf16: its attention as it is, its MoE cut to fit one GPU."""
    config = json.loads(V3_CONFIG.read_text())
    config.pop("quantization_config", None)
    return {**config, "num_hidden_layers": layers, "first_k_dense_replace": min(3, layers - 1),
            "n_routed_experts": experts, "num_nextn_predict_layers": 0}


def run_agreement(args) -> list[dict]:
    from afd.models.loader import LoadedModel, load_model

    rows = []
    if args.tiny:
        from afd.checkpoint_tools.tiny import make_tiny_model

        root = Path(args.models)
        for arch in args.tiny.split(","):
            folder = root / arch
            if not (folder / "config.json").exists():
                make_tiny_model(arch, folder, seed=0)
            for dtype in (torch.float32, torch.bfloat16):
                loaded = load_model(str(folder), dtype=dtype)
                got = agreement(loaded, dtype, "cpu", agreement_prompts(loaded.spec.vocab_size))
                rows.append({"model": f"tiny {arch}", "dtype": str(dtype).removeprefix("torch."), **got})
                print(json.dumps(rows[-1]), flush=True)
        return rows
    require_cuda()
    from bench.harness.random_weights import random_model

    config = v3_shaped(args.layers, args.experts)
    model, spec, crossing = random_model(config, "monolithic")
    loaded = LoadedModel(model, spec, crossing, "random")
    got = agreement(loaded, torch.bfloat16, "cuda", agreement_prompts(spec.vocab_size))
    rows.append({"model": f"deepseek-v3-shaped ({args.layers} layers, {args.experts} experts)", "dtype": "bfloat16",
                 "device": torch.cuda.get_device_name(), **got})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def run_step(args) -> list[dict]:
    """The monolith's decode-step graph replay over a bf16 and an FP8 cache, at V2-Lite shape."""
    require_cuda()
    from afd.graphs.decode import DecodeGraphs
    from afd.kv.cache import KVCache
    from afd.models.kv_dtype import FP8, quantize
    from afd.models.loader import LoadedModel
    from afd.runners.monolithic_runner import MonolithicRunner
    from afd.step.stages import StagePolicy
    from bench.harness.random_weights import random_model
    from bench.harness.shapes import V2_LITE, v2_lite
    from bench.step.step_floor import measure

    config = v2_lite(args.layers) if args.layers else V2_LITE
    model, spec, crossing = random_model(config, "monolithic")
    loaded = LoadedModel(model, spec, crossing, "random")
    rows = []
    for dtype in (torch.bfloat16, FP8):
        blocks = args.batch * (-(-(args.context + 1) // 16)) + 8
        kv = KVCache(model.kv_layouts(), blocks, dtype, "cuda", block_size=16)
        for tensor in kv.keys + [v for v, lay in zip(kv.values, kv.layouts) if not lay.values_in_keys]:
            if dtype == FP8:  # noise, not zeros: timings on zeros flatter
                noise = quantize(torch.randn(tensor.shape, device="cuda"), FP8)
                tensor.view(torch.uint8).copy_(noise.view(torch.uint8))
            else:
                tensor.normal_(0, 1)
        runner = MonolithicRunner(loaded, kv)
        with torch.inference_mode():
            runner.graphs = DecodeGraphs(lambda ids, micro: model(ids, micro[0][1], kv), kv, (args.batch,),
                                         StagePolicy(), kv.keys[0].device)
            runner.graphs.capture_all()
            got = measure(runner, runner.graphs, kv, args.batch, args.context, spec.vocab_size, args.steps)
        rows.append({"cache": str(dtype).removeprefix("torch."), "batch": args.batch, "context": args.context,
                     "layers": spec.num_layers, "cache_gib": kv.nbytes / 2**30, "gpu_ms": got["gpu_ms"],
                     "wall_ms": got["wall_ms"], "device": torch.cuda.get_device_name()})
        print(json.dumps(rows[-1]), flush=True)
        runner.graphs = None
        del runner, kv
        torch.cuda.empty_cache()
    ratio = rows[1]["gpu_ms"] / rows[0]["gpu_ms"]
    print(f"decode step {args.batch} x {args.context:,}, V2-Lite shape, {rows[0]['device']}: bf16 cache "
          f"{rows[0]['gpu_ms']:.2f} ms, FP8 cache {rows[1]['gpu_ms']:.2f} ms, FP8 / bf16 = {ratio:.3f} (goal <= 0.9)")
    return rows + [{"fp8_over_bf16": ratio}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    step = modes.add_parser("step")
    step.add_argument("--batch", type=int, default=256)
    step.add_argument("--context", type=int, default=2048)
    step.add_argument("--layers", type=int, default=0, help="decoder layers (0: V2-Lite's 27)")
    step.add_argument("--steps", type=int, default=20)
    agree = modes.add_parser("agreement")
    agree.add_argument("--shape", choices=("deepseek-v3",), default="deepseek-v3")
    agree.add_argument("--layers", type=int, default=4)
    agree.add_argument("--experts", type=int, default=16)
    agree.add_argument("--tiny", default="", help="tiny architectures, comma-separated (CPU), instead of --shape")
    agree.add_argument("--models", default="/tmp/afd-kv-fp8-tiny", help="where the tiny checkpoints are kept")
    args = parser.parse_args()
    rows = run_step(args) if args.mode == "step" else run_agreement(args)
    if args.mode == "agreement":
        firsts = [f for row in rows for f in row["first_differing_token"]]
        print(f"{statistics.mean(f is None for f in firsts):.2f} of prompts agree on all {NEW_TOKENS} tokens")
    write_json(f"kv_fp8_{args.mode}", {"rows": rows})


if __name__ == "__main__":
    main()
