"""DeepSeek-V3.2's sparse MLA on one GPU, at its real attention and indexer dims (128 heads, latent 512 + 64, 64
index heads of 128, index_topk 2,048), bf16.

Decode (graph-replayed, median ms) at each batch and context: the indexer (index scores over the paged index cache,
then top-k), the sparse latent attention over the chosen rows, the whole sparse step, and the dense latent kernel
over every row (what V3 runs); each against its byte floor (bytes it must read / the measured copy bandwidth): the
indexer reads context x 128 x 2 B a sequence, the sparse attention 2,048 x 576 x 2 B, the dense one context x 576 x
2 B. Past the indexer's own cost, the sparse attention's time should not grow with the context.

Prefill: one attention layer's `attend` (index keys and latent rows stored, queries over their keys) for one prompt of
`--prefill` tokens, fed in chunks of `--chunk` (event-timed, median ms): sparse (the indexer, then index_topk rows a
query, absorbed) against dense MLA (the same layer with index_topk past the prompt: the expanded varlen kernel).

`python3 bench/kernels/sparse_mla.py [--batches 1,32,128] [--contexts 4096,16384,32768] [--prefill 16384]`
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import ceilings, require_cuda, time_callable, time_graph, write_json  # noqa: E402

V32_ATTENTION = dict(
    model_type="deepseek_v32", hidden_size=7168, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128,
    index_topk=2048, max_position_embeddings=163840, rope_theta=10000,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)
LATENT, ROPE, INDEX_DIM, INDEX_HEADS, HEADS, TOPK = 512, 64, 128, 64, 128, 2048


def decode_rows(batches, contexts, bandwidth: float) -> list[dict]:
    from afd.kernels.decode_attention import paged_latent_decode_attention
    from afd.kernels.sparse_mla import (chosen_positions, paged_index_scores, sparse_latent_attention,
                                        sparse_latent_decode)

    rows, block, bf16 = [], 64, torch.bfloat16
    print(f"{'batch':>6} {'context':>8} {'indexer ms':>11} {'floor':>7} {'sparse attn ms':>15} {'floor':>7} "
          f"{'sparse step ms':>15} {'dense attn ms':>14} {'floor':>7}")
    for context in contexts:
        for batch in batches:
            width = -(-context // block)
            table = torch.randperm(batch * width, device="cuda").to(torch.int32).view(batch, width)
            lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            cache_rows = (batch * width + 1) * block
            cache = torch.randn(cache_rows, 1, LATENT + ROPE, device="cuda", dtype=bf16)
            index_cache = torch.randn(cache_rows, INDEX_DIM, device="cuda", dtype=bf16)
            q = torch.randn(batch, HEADS, LATENT, device="cuda", dtype=bf16)
            q_rope = torch.randn(batch, HEADS, ROPE, device="cuda", dtype=bf16)
            index_q = torch.randn(batch, INDEX_HEADS, INDEX_DIM, device="cuda", dtype=bf16)
            index_w = torch.randn(batch, INDEX_HEADS, device="cuda")
            scale, index_scale = 0.1, INDEX_DIM**-0.5

            def indexer():
                return chosen_positions(paged_index_scores(index_q, index_w, index_cache, index_scale, table, lens,
                                                           block), TOPK)

            positions = indexer()
            indexer_ms = time_graph(indexer)
            sparse_ms = time_graph(lambda: sparse_latent_attention(q, q_rope, cache, LATENT, positions, table, lens,
                                                                   block, scale))
            step_ms = time_graph(lambda: sparse_latent_decode(q, q_rope, cache, LATENT, index_q, index_w, index_cache,
                                                              index_scale, TOPK, table, lens, block, scale))
            dense_ms = time_graph(lambda: paged_latent_decode_attention(q, cache, LATENT, table, lens, block, scale,
                                                                        q_rope=q_rope))
            floors = {name: bytes_ / bandwidth * 1e3 for name, bytes_ in (
                ("indexer", batch * context * INDEX_DIM * 2), ("sparse", batch * TOPK * (LATENT + ROPE) * 2),
                ("dense", batch * context * (LATENT + ROPE) * 2))}
            rows.append(dict(batch=batch, context=context, indexer_ms=indexer_ms, sparse_attention_ms=sparse_ms,
                             sparse_step_ms=step_ms, dense_attention_ms=dense_ms,
                             **{f"{name}_floor_ms": value for name, value in floors.items()}))
            print(f"{batch:>6} {context:>8} {indexer_ms:>11.3f} {floors['indexer']:>7.3f} {sparse_ms:>15.3f} "
                  f"{floors['sparse']:>7.3f} {step_ms:>15.3f} {dense_ms:>14.3f} {floors['dense']:>7.3f}")
            del cache, index_cache
            torch.cuda.empty_cache()
    return rows


def prefill_rows(length: int, chunk: int) -> list[dict]:
    from afd.kv.cache import KVCache
    from afd.models.deepseek_v32 import SparseLatentAttention
    from afd.models.paged_attention import AttentionBatch

    torch.manual_seed(0)
    layer = SparseLatentAttention(V32_ATTENTION).cuda().to(torch.bfloat16).eval().requires_grad_(False)
    for param in layer.parameters():
        param.data.normal_(0, 0.02)
    layer.indexer.weights_proj.float()
    block = 64
    cache = KVCache([layer.kv_layout], -(-length // block) + 1, torch.bfloat16, "cuda", block_size=block)
    table = list(range(-(-length // block)))
    x = torch.randn(length, 7168, device="cuda", dtype=torch.bfloat16)
    rows = []
    print(f"prefill of {length} tokens in chunks of {chunk}: one layer's attend, ms")
    for name, topk in (("sparse", TOPK), ("dense", 10**9)):
        layer.index_topk = topk
        steps = []
        for start in range(0, length, chunk):
            count = min(chunk, length - start)
            batch = AttentionBatch.build([table], [start], [count], block, "cuda")
            with torch.inference_mode():
                inputs = layer.project(x[start : start + count], batch.positions)
                layer.attend(inputs, batch, *cache.layer(0))  # fills the cache for the chunks after it
            steps.append((batch, inputs))

        def run():
            with torch.inference_mode():
                for batch, inputs in steps:
                    layer.attend(inputs, batch, *cache.layer(0))

        total_ms = time_callable(run, 3)
        rows.append(dict(mode=name, tokens=length, chunk=chunk, attend_ms=total_ms))
        print(f"  {name:>6}: {total_ms:9.2f} ms")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--prefill", type=int, default=16384, help="prompt tokens (0: no prefill figures)")
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk (the step's token budget)")
    args = parser.parse_args()
    require_cuda(__file__)
    measured = ceilings()
    bandwidth = measured["copy_bytes_per_s"] / 2  # a copy reads and writes: bytes read per second
    print(f"{torch.cuda.get_device_name()}: {bandwidth / 1e12:.2f} TB/s read (from a copy)")
    decode = decode_rows([int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")],
                         bandwidth)
    prefill = prefill_rows(args.prefill, args.chunk) if args.prefill else []
    write_json("sparse_mla", dict(device=torch.cuda.get_device_name(), ceilings=measured, decode=decode,
                                  prefill=prefill))


if __name__ == "__main__":
    main()
