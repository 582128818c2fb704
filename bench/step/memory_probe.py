"""What building the DeepSeek-V2-Lite-shaped model leaves held on the GPU, and the KV cache `afd serve` sizes from
what is left (issue 33's KV item), on one GPU:

    python3 bench/step/memory_probe.py [--layers 0] [--now-only]

Builds the model as the loader did before issue 33 (float32, then converted) and as it does now, printing after
each the bytes allocated, held by the caching allocator (emptied) and used on the device; then the monolith's KV
sizing at 256 sequences and 2,048-token steps with CUDA graphs. Writes $OUT/memory_probe.json.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import require_cuda, write_json  # noqa: E402
from bench.harness.random_weights import random_model  # noqa: E402
from bench.harness.shapes import V2_LITE  # noqa: E402


def memory_probe(layers: int, before: bool = True) -> dict:
    """Bytes allocated, held by the allocator and used on the device after building the DeepSeek-V2-Lite-shaped model,
    the caching allocator emptied: as the loader did before issue 33 (float32, then converted) and as it does now."""
    from afd.models import loader

    def state(label: str) -> dict:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        got = {"label": label, "allocated_gib": torch.cuda.memory_allocated() / 2**30,
               "reserved_gib": torch.cuda.memory_reserved() / 2**30, "device_used_gib": (total - free) / 2**30}
        print(f"memory {label:<28} allocated {got['allocated_gib']:6.2f} GiB  held by the allocator "
              f"{got['reserved_gib']:6.2f}  used on the device {got['device_used_gib']:6.2f}", flush=True)
        return got

    def old_build_share(config, role, gate_on_attention, dtype, device, shard=(0, 1)):
        spec = loader.parse_spec(config)
        with torch.device("meta"):
            model = loader.FAMILIES[spec.arch](config, spec)
        crossing = loader.crossing_layers(spec.moe_layers, gate_on_attention)
        loader.prune_for_role(model, role, crossing, gate_on_attention)
        model.to_empty(device=device)  # float32 first ...
        model.to(dtype)  # ... then converted, parameter by parameter
        for module in model.modules():
            if isinstance(module, loader.Router) and module.fp32_logits:
                module.float()
        return model, spec, crossing

    config = {**V2_LITE, "num_hidden_layers": layers or V2_LITE["num_hidden_layers"]}
    out = [state("empty")]
    new_build = loader.build_share
    builds = [("float32 then bf16 (before)", old_build_share)] if before else []
    for label, build in builds + [("bf16 at once (now)", new_build)]:
        loader.build_share = build
        try:
            model, spec, crossing = random_model(config, "monolithic")
        finally:
            loader.build_share = new_build
        out.append(state(label))
        if build is new_build:
            out.append(kv_sizing(model, spec, crossing))
        del model
        out.append(state("freed"))
    return {"layers": config["num_hidden_layers"], "states": out}


def kv_sizing(model, spec, crossing) -> dict:
    """What `afd serve` would size the monolith's KV cache to here (256 sequences, 2,048-token steps, graphs)."""
    from afd.config import AFDConfig
    from afd.kv.budget import CudaMemory
    from afd.models.loader import LoadedModel
    from afd.roles.kv_sizing import profiled_cache_tokens

    config = AFDConfig(role="monolithic", device="cuda", dtype="bfloat16", max_num_seqs=256,
                       max_num_batched_tokens=2048, cuda_graphs=True, max_model_len=4096)
    tokens = profiled_cache_tokens(config, LoadedModel(model, spec, crossing, "random"),
                                   CudaMemory(torch.device("cuda", torch.cuda.current_device())), torch.bfloat16,
                                   torch.device("cuda", torch.cuda.current_device()))
    print(f"memory KV cache sized to {tokens:,} tokens", flush=True)
    return {"label": "kv tokens", "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's own)")
    parser.add_argument("--now-only", action="store_true", help="without the old loading order")
    args = parser.parse_args()
    require_cuda(__file__)
    run(args.layers, before=not args.now_only)


def run(layers: int, before: bool = True) -> None:
    """The probe with the loaders' log lines shown; its states into $OUT/memory_probe.json."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    write_json("memory_probe", memory_probe(layers, before))


if __name__ == "__main__":
    main()
