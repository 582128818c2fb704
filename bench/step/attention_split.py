"""Issue 16 (2): the attention-only AFD step against the attention part of the monolithic step, on one GPU.

    python3 bench/step/attention_split.py [--layers 27] [--batches 64,256,512] [--contexts 128,2048]

DeepSeek-V2-Lite-shaped random bf16 model, CUDA graphs, every sequence with --context cached
tokens. Per batch and context, median wall-clock ms of a decode step (`runner(ids).argmax().tolist()`):
  mono        the whole monolithic step (attention + MoE);
  mono_attn   the same monolithic step with every layer's FFN returning zeros: its attention part;
  afd_s1/s2   the AFD attention rank's step (AttentionRunner, 1 or 2 micro-batches) with no FFN
              behind its connector (the FFN output is zeros), i.e. the attention-only step.
The goal is afd_s{1,2} / mono_attn <= 1.1. Writes $OUT/attention_split.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.decode_steps import NoFFN, capture_decode_graphs, kv_cache_for, time_steps  # noqa: E402
from bench.harness.measure import require_cuda, write_json  # noqa: E402
from bench.harness.random_weights import random_model  # noqa: E402
from bench.harness.shapes import v2_lite  # noqa: E402


class _ZeroFFN(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--batches", default="64,256,512")
    parser.add_argument("--contexts", default="128,2048")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    require_cuda(__file__)
    batches = [int(b) for b in args.batches.split(",")]

    from afd.models.loader import LoadedModel
    from afd.runners.attention_runner import AttentionRunner, StepOptions
    from afd.step.stages import StagePolicy
    from afd.runners.monolithic_runner import MonolithicRunner

    config = v2_lite(args.layers)
    vocab, rows = config["vocab_size"], []
    for context in (int(c) for c in args.contexts.split(",")):
        result = {b: {"batch": b, "context": context} for b in batches}
        model, spec, crossing = random_model(config, "monolithic")
        kv = kv_cache_for(model, max(batches), context)
        for label in ("mono", "mono_attn"):
            if label == "mono_attn":
                for layer in model.layers:
                    layer.mlp = _ZeroFFN()
            runner = MonolithicRunner(LoadedModel(model, spec, crossing, "random"), kv)
            with torch.inference_mode():
                runner.graphs = capture_decode_graphs(lambda ids, micro: model(ids, micro[0][1], kv), kv, batches)
            for batch in batches:
                result[batch][label] = time_steps(runner, kv, batch, args.steps, context, vocab)["ms"]
            runner.graphs = None
        del model, kv, runner
        torch.cuda.empty_cache()
        model, spec, crossing = random_model(config, "attention")
        loaded = LoadedModel(model, spec, crossing, "random")
        kv = kv_cache_for(model, max(batches), context)
        for stages in (1, 2):
            solo = AttentionRunner(loaded, NoFFN(), kv, StepOptions(StagePolicy(stages)))
            solo.capture_graphs(buckets=batches)
            for batch in batches:
                result[batch][f"afd_s{stages}"] = time_steps(solo, kv, batch, args.steps, context, vocab)["ms"]
            solo.graphs = None
        del model, kv, solo, loaded
        torch.cuda.empty_cache()
        for batch in batches:
            row = result[batch]
            row["s1_over_mono_attn"] = row["afd_s1"] / row["mono_attn"]
            row["s2_over_mono_attn"] = row["afd_s2"] / row["mono_attn"]
            rows.append(row)
            print(f"context {context:>5} batch {batch:>4}: mono {row['mono']:7.2f} ms  mono_attn {row['mono_attn']:7.2f}  "
                  f"afd_s1 {row['afd_s1']:7.2f} ({row['s1_over_mono_attn']:.2f}x)  afd_s2 {row['afd_s2']:7.2f} "
                  f"({row['s2_over_mono_attn']:.2f}x)", flush=True)
    write_json("attention_split", {"layers": args.layers, "rows": rows})


if __name__ == "__main__":
    main()
