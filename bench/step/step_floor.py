"""The decode step against its floor (issue 33): time, floor, ratio and kernels per step, on one GPU.

    python3 bench/step/step_floor.py [--shapes deepseek-v2-lite,qwen3-30b-a3b] [--layers 0] [--batches 1,64,256] [--pdl off,on]
                                [--contexts 128,2048] [--steps 20]
    python3 bench/step/step_floor.py --memory-probe   # bench/step/memory_probe.py: what the model leaves held on the GPU (KV)

Random bf16 weights at each sample shape (`--layers 0`: the model's own depth), CUDA graphs,
every sequence with `context` cached tokens. Per shape, batch and context, three steps:
  mono    the monolithic step (attention + FFN);
  attn1   the AFD attention rank's step with one micro-batch, no FFN behind its link (zeros come back);
  attn2   the same with two micro-batches (each reads the layers' weights: its floor counts them twice).
For each: `gpu_ms` (CUDA events around the graph's replay), `wall_ms` (`runner(ids).argmax().tolist()`, what a
serving loop sees), the floor from what the step really touches and the measured device ceilings
(bytes: every dense weight once, the routed experts the step's routing actually hit, the embedding rows, the
KV it reads; FLOPs: 2 per weight per token on the matmuls, plus attention over the context; the floor is the
larger of bytes / copy rate and FLOPs / bf16 matmul rate), `ratio` = gpu_ms / floor, and the kernels of one
replayed step from the profiler (per layer too). Writes $OUT/step_floor.json; prints a table last, where
`attn2/attn1` (time) stands beside `floor2/floor1`, the least that ratio can be when both steps run at their floors.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import ceilings, count_kernels, require_cuda, time_callable, write_json  # noqa: E402
from bench.harness.random_weights import random_model  # noqa: E402
from bench.harness.shapes import QWEN3_30B_A3B, V2_LITE  # noqa: E402

SHAPES = {"deepseek-v2-lite": V2_LITE, "qwen3-30b-a3b": QWEN3_30B_A3B}


# ---------------------------------------------------------------- the floor (pure; tests/runtime/test_step_floor.py)
@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's routed experts: bytes and weights of one expert, how many each token visits."""

    expert_bytes: int
    expert_params: int
    top_k: int


@dataclass(frozen=True)
class ModelTraffic:
    """What a decode step of a model reads whatever its batch: weights read whole, routed experts per layer,
    and per token the embedding row, the KV bytes cached and the attention's multiply-adds per cached token."""

    dense_bytes: int  # attention, norms, dense MLPs, shared experts, routers, LM head: read once a step
    dense_params: int  # their weights that multiply every token (2 FLOPs each per token)
    experts: tuple[ExpertLayer, ...]
    embed_row_bytes: int
    kv_bytes_per_token: int  # all layers
    attention_flops_per_cached_token: int  # all layers, per sequence (scores + weighted sum)
    layer_dense_bytes: int = 0  # the part of dense_bytes in the decoder layers: read again by each micro-batch


def model_traffic(model) -> ModelTraffic:
    """`ModelTraffic` of a loaded (or random) `MoECausalLM`, from its modules' real tensors."""
    from afd.models.layers import Experts, Router

    dense_bytes = dense_params = 0
    experts = []
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, Experts):
            per_bytes = module.gate_up[0].numel() * module.gate_up.element_size() + module.down[0].numel() * module.down.element_size()
            per_params = module.gate_up[0].numel() + module.down[0].numel()
            dense_bytes += module.num_shared * per_bytes  # shared experts folded in: every token visits them
            dense_params += module.num_shared * per_params
            experts.append((per_bytes, per_params))
            seen.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, Router):
            weight = module.weight_parts if module.weight_parts is not None else module.weight
            dense_bytes += weight.numel() * weight.element_size()
            dense_params += module.weight.numel()
            seen.update(id(p) for p in module.parameters(recurse=False))
    embed = model.model.embed_tokens.weight
    seen.add(id(embed))
    layer_dense_bytes = dense_bytes  # so far the shared experts and routers: all in the decoder layers
    in_layers = {id(p) for p in model.layers.parameters()}
    for param in model.parameters():
        if id(param) not in seen:
            dense_bytes += param.numel() * param.element_size()
            layer_dense_bytes += param.numel() * param.element_size() if id(param) in in_layers else 0
            dense_params += param.numel() if param.dim() > 1 else 0  # norms' weights scale, they do not multiply
    top_ks = [layer.mlp.routing.top_k for layer in model.layers if layer.mlp is not None and hasattr(layer.mlp, "routing")]
    element = embed.element_size()
    kv_per_token = sum(lay.elements_per_token for lay in model.kv_layouts()) * element
    attn_flops = 0
    for layer in model.layers:
        attn, lay = layer.self_attn, layer.self_attn.kv_layout
        attn_flops += 2 * attn.heads * (lay.key_dim + lay.value_dim)  # q·k over key_dim, p·v over value_dim
    layers = tuple(ExpertLayer(b, p, k) for (b, p), k in zip(experts, top_ks or [0] * len(experts)))
    return ModelTraffic(dense_bytes, dense_params, layers, embed.shape[1] * element, kv_per_token, attn_flops,
                        layer_dense_bytes)


@dataclass(frozen=True)
class Floor:
    bytes: int
    flops: int
    bytes_ms: float
    flops_ms: float

    @property
    def ms(self) -> float:
        return max(self.bytes_ms, self.flops_ms)


def step_floor(traffic: ModelTraffic, batch: int, context: int, experts_hit: list[int],
               copy_bytes_per_s: float, flops_per_s: float, micro_batches: int = 1) -> Floor:
    """The floor of a decode step of `batch` sequences of `context` cached tokens (+1 new), whose routing hit
    `experts_hit[i]` distinct routed experts in MoE layer i, run as `micro_batches` passes over the layers (each
    reads the layers' dense weights; the embedding and LM head are read once)."""
    if batch < 1 or context < 0:
        raise ValueError(f"batch {batch} and context {context}: need batch >= 1 and context >= 0")
    if len(experts_hit) != len(traffic.experts):
        raise ValueError(f"{len(experts_hit)} expert-hit counts for {len(traffic.experts)} MoE layers")
    keys = context + 1
    moved = (traffic.dense_bytes + (micro_batches - 1) * traffic.layer_dense_bytes + batch * traffic.embed_row_bytes
             + batch * keys * traffic.kv_bytes_per_token
             + sum(hit * layer.expert_bytes for hit, layer in zip(experts_hit, traffic.experts)))
    flops = (2 * batch * traffic.dense_params + batch * keys * traffic.attention_flops_per_cached_token
             + sum(2 * batch * layer.top_k * layer.expert_params for layer in traffic.experts))
    return Floor(moved, flops, moved / copy_bytes_per_s * 1e3, flops / flops_per_s * 1e3)


# ---------------------------------------------------------------- measuring (CUDA)
@contextlib.contextmanager
def recording_routes(record: list):
    """While open, every `Routing.select` appends its expert ids (an eager step's routing, layer by layer)."""
    from afd.models.layers import Routing

    original = Routing.select

    def select(self, *args, **kwargs):
        weights, ids = original(self, *args, **kwargs)
        record.append(ids)
        return weights, ids

    Routing.select = select
    try:
        yield record
    finally:
        Routing.select = original


def _layout(kv, batch: int, context: int):
    from afd.step.layout import SeqLayout

    tables = [tuple(kv.allocate(context + 1)) for _ in range(batch)]
    return tables, SeqLayout(tuple(tables), (context,) * batch, (1,) * batch)


def measure(runner, graphs, kv, batch: int, context: int, vocab: int, steps: int) -> dict:
    """gpu_ms of the bucket's graph replay, wall_ms of the runner's step, kernels of one replayed step."""
    import statistics
    import time

    tables, layout = _layout(kv, batch, context)
    ids = torch.randint(0, vocab, (batch,), device="cuda")
    try:
        runner(ids, layout).argmax(-1).tolist()  # fills the graph's inputs for this layout
        graph = graphs.graphs[batch]
        gpu_ms = time_callable(graph.replay, steps)
        walls = []
        for _ in range(steps + 3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            runner(ids, layout).argmax(-1).tolist()
            walls.append((time.perf_counter() - start) * 1e3)
        kernels = count_kernels(graph.replay)
    finally:
        for table in tables:
            kv.release(table)
    return {"gpu_ms": gpu_ms, "wall_ms": statistics.median(walls[3:]), **kernels}


def experts_hit(runner, kv, batch: int, context: int, vocab: int, layers: int) -> list[int]:
    """Distinct routed experts per MoE layer in one eager step of this batch (random tokens)."""
    tables, layout = _layout(kv, batch, context)
    ids = torch.randint(0, vocab, (batch,), device="cuda")
    graphs, runner.graphs = runner.graphs, None
    try:
        with recording_routes([]) as routes:
            runner(ids, layout).argmax(-1).tolist()
    finally:
        runner.graphs = graphs
        for table in tables:
            kv.release(table)
    if len(routes) != layers:
        raise RuntimeError(f"{len(routes)} routings recorded for {layers} MoE layers")
    return [int(torch.unique(r).numel()) for r in routes]


def kv_cache(model, batch: int, context: int):
    from afd.kv.cache import KVCache

    kv = KVCache(model.kv_layouts(), batch * (-(-(context + 1) // 16)) + 8, torch.bfloat16, "cuda", block_size=16)
    for tensor in kv.keys + [v for v, lay in zip(kv.values, kv.layouts) if not lay.values_in_keys]:
        tensor.normal_(0, 1)  # not zeros: timings on zeros flatter
    return kv


def fitting_kv_cache(model, batches: list[int], contexts: list[int], make=kv_cache):
    """The KV cache for the largest batch (at the longest context) that fits beside the model, and the batches it
    serves: a batch too large for this GPU (Qwen3-30B-A3B's 256 × 2,048 on 80 GB) is named and left out, not the
    whole shape."""
    batches = sorted(batches)
    while True:
        try:
            return make(model, batches[-1], max(contexts)), batches
        except torch.OutOfMemoryError:
            if len(batches) == 1:
                raise
            print(f"batch {batches[-1]} × context {max(contexts):,}: its KV cache does not fit beside the weights "
                  "on this GPU; measured without it", flush=True)
            batches = batches[:-1]
            torch.cuda.empty_cache()  # a no-op where CUDA never started


def run_shape(name: str, config: dict, batches: list[int], contexts: list[int], steps: int, rates: dict,
              pdl_settings: tuple[bool, ...] = (False,)) -> list[dict]:
    from afd.graphs.decode import DecodeGraphs
    from afd.models.loader import LoadedModel
    from afd.runners.attention_runner import AttentionRunner, StepOptions
    from afd.step.stages import StagePolicy
    from afd.runners.monolithic_runner import MonolithicRunner
    from afd.runners.profile_step import StandInFFN

    rows = []
    vocab = config["vocab_size"]
    model, spec, crossing = random_model(config, "monolithic")
    kv, batches = fitting_kv_cache(model, batches, contexts)
    mono = model_traffic(model)
    moe_layers = len(mono.experts)
    runner = MonolithicRunner(LoadedModel(model, spec, crossing, "random"), kv)
    hits = {}
    for pdl in pdl_settings:
        with pdl_launches(pdl), torch.inference_mode():
            runner.graphs = DecodeGraphs(lambda ids, micro: model(ids, micro[0][1], kv), kv, tuple(sorted(batches)),
                                         StagePolicy(), kv.keys[0].device)
            runner.graphs.capture_all()
            hits = hits or {b: experts_hit(runner, kv, b, min(contexts), vocab, moe_layers) for b in batches}
            for context in contexts:
                for batch in batches:
                    got = measure(runner, runner.graphs, kv, batch, context, vocab, steps)
                    rows.append(_row(name, "mono", batch, context, got,
                                     step_floor(mono, batch, context, hits[batch], **rates), spec.num_layers, hits[batch], pdl))
                    print(_line(rows[-1]), flush=True)
        runner.graphs = None
    del runner, model
    torch.cuda.empty_cache()
    model, spec, crossing = random_model(config, "attention")
    attn = model_traffic(model)
    loaded = LoadedModel(model, spec, crossing, "random")
    for stages, pdl in itertools.product((1, 2), pdl_settings):
        with pdl_launches(pdl):
            solo = AttentionRunner(loaded, StandInFFN(), kv, StepOptions(StagePolicy(stages)))
            solo.capture_graphs(buckets=batches)
            for context in contexts:
                for batch in batches:
                    got = measure(solo, solo.graphs, kv, batch, context, vocab, steps)
                    parts = sum(1 for count in StagePolicy(stages).rows(batch) if count)
                    rows.append(_row(name, f"attn{stages}", batch, context, got,
                                     step_floor(attn, batch, context, [], **rates, micro_batches=parts),
                                     spec.num_layers, [], pdl))
                    print(_line(rows[-1]), flush=True)
            solo.graphs = None
    del solo, loaded, model, kv
    torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def pdl_launches(on: bool):
    """Kernels launched and graphs captured inside run with programmatic dependent launch on or off (AFD_PDL)."""
    from afd.kernels import pdl

    before = os.environ.get("AFD_PDL")
    os.environ["AFD_PDL"] = "true" if on else "false"
    pdl.enabled.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("AFD_PDL")
        else:
            os.environ["AFD_PDL"] = before
        pdl.enabled.cache_clear()


def _row(shape, mode, batch, context, got, floor: Floor, layers: int, hits: list[int], pdl: bool = False) -> dict:
    top = sorted(got["by_name"].items(), key=lambda kv: -kv[1])[:25]
    slowest = sorted(got["us_by_name"].items(), key=lambda kv: -kv[1])[:15]
    return {"shape": shape, "mode": mode, "pdl": pdl, "batch": batch, "context": context, "gpu_ms": got["gpu_ms"],
            "wall_ms": got["wall_ms"], "floor_ms": floor.ms, "bytes_floor_ms": floor.bytes_ms,
            "flops_floor_ms": floor.flops_ms, "floor": asdict(floor), "ratio": got["gpu_ms"] / floor.ms,
            "kernels": got["kernels"], "kernels_per_layer": got["kernels"] / layers, "copies": got["copies"],
            "experts_hit_mean": sum(hits) / len(hits) if hits else 0, "top_kernels": top,
            "slowest_kernels_us": slowest}


def _line(row: dict) -> str:
    return (f"{row['shape']:<17} {row['mode']:<5}{' pdl' if row['pdl'] else '    '} b {row['batch']:>4} ctx {row['context']:>5}  gpu {row['gpu_ms']:7.3f} ms"
            f"  wall {row['wall_ms']:7.3f}  floor {row['floor_ms']:6.3f} ({'bytes' if row['bytes_floor_ms'] >= row['flops_floor_ms'] else 'flops'})"
            f"  ratio {row['ratio']:5.2f}  kernels {row['kernels']:5d} ({row['kernels_per_layer']:.1f}/layer)")


def parse_pdl(text: str) -> tuple[bool, ...]:
    """`--pdl`: "off", "on" or both, in the order given."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    if not words or any(w not in ("off", "on") for w in words):
        raise SystemExit(f"--pdl {text!r}: give off, on or off,on")
    return tuple(dict.fromkeys(w == "on" for w in words))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="deepseek-v2-lite,qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's own)")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--contexts", default="128,2048")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pdl", default="off", help="off, on or off,on: each step measured with programmatic "
                        "dependent launch off and/or on (AFD_PDL), graphs captured anew for each, one model build")
    parser.add_argument("--memory-probe", action="store_true", help="run bench/step/memory_probe.py instead")
    parser.add_argument("--probe-now-only", action="store_true", help="--memory-probe without the old loading order")
    args = parser.parse_args()
    require_cuda(__file__)
    if args.memory_probe:
        from bench.step import memory_probe

        memory_probe.run(args.layers, before=not args.probe_now_only)
        return
    pdl_settings = parse_pdl(args.pdl)
    batches = sorted({int(b) for b in args.batches.split(",")})
    contexts = [int(c) for c in args.contexts.split(",")]
    measured = ceilings()
    rates = {"copy_bytes_per_s": measured["copy_bytes_per_s"], "flops_per_s": measured["bf16_flops"]}
    print(f"ceilings: copy {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 {rates['flops_per_s'] / 1e12:.0f} TFLOP/s",
          flush=True)
    rows = []
    for name in args.shapes.split(","):
        config = {**SHAPES[name]}
        if args.layers:
            config["num_hidden_layers"] = args.layers
        rows += run_shape(name, config, batches, contexts, args.steps, rates, pdl_settings)
    write_json("step_floor", {"ceilings": measured, "layers": args.layers, "rows": rows})
    print("\nshape             mode  pdl batch   ctx   gpu ms  wall ms  floor ms  ratio  kernels/layer  attn2/attn1"
          "  floor2/floor1  pdl on/off")
    by_key = {(r["shape"], r["mode"], r["pdl"], r["batch"], r["context"]): r for r in rows}
    for r in rows:
        one = by_key.get((r["shape"], "attn1", r["pdl"], r["batch"], r["context"]))
        split = f"{r['gpu_ms'] / one['gpu_ms']:.2f}" if r["mode"] == "attn2" and one else ""
        least = f"{r['floor_ms'] / one['floor_ms']:.2f}" if r["mode"] == "attn2" and one else ""
        off = by_key.get((r["shape"], r["mode"], False, r["batch"], r["context"]))
        gain = f"{r['gpu_ms'] / off['gpu_ms']:.3f}" if r["pdl"] and off else ""
        print(f"{r['shape']:<17} {r['mode']:<5} {'on' if r['pdl'] else 'off':>3} {r['batch']:>5} {r['context']:>5}"
              f" {r['gpu_ms']:8.3f} {r['wall_ms']:8.3f} {r['floor_ms']:9.3f} {r['ratio']:6.2f}"
              f" {r['kernels_per_layer']:13.1f}  {split:>11}  {least:>13}  {gain:>10}")


if __name__ == "__main__":
    main()
