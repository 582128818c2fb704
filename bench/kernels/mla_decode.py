"""MLA decode attention: the latent cache (one 576-wide row per token and layer) against the
expanded per-head cache it replaces, at DeepSeek-V2-Lite shapes on one GPU.

Prints, per batch and context: the paged-decode kernel time over each cache (graph-replayed,
median ms), the whole MLA layer's decode time with the latent cache, and the cache bytes per
token and the tokens a fixed budget holds. `python3 bench/kernels/mla_decode.py [--budget-gib 100]`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from bench.harness.measure import require_cuda, time_graph, write_json  # noqa: E402
from bench.harness.shapes import V2_LITE  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="64,256,512")
    parser.add_argument("--contexts", default="128,2048")
    parser.add_argument("--budget-gib", type=float, default=100.0)
    args = parser.parse_args()
    require_cuda(__file__)

    from afd.kernels.decode_attention import paged_decode_attention, paged_latent_decode_attention
    from afd.kv.cache import KVCache
    from afd.models.paged_attention import AttentionBatch
    from afd.models.deepseek_v2 import MultiHeadLatentAttention
    from afd.models.spec import KVLayout, kv_layout

    heads, latent, rope, nope, v_dim = 16, 512, 64, 128, 128
    layers = V2_LITE["num_hidden_layers"]
    latent_layout, expanded_layout = kv_layout(V2_LITE), KVLayout(heads, nope + rope, v_dim)
    per_token = {name: KVCache.bytes_per_token([lay] * layers, torch.bfloat16)
                 for name, lay in (("latent", latent_layout), ("expanded", expanded_layout))}
    budget = int(args.budget_gib * 2**30)
    print(f"bytes per token, {layers} layers: latent {per_token['latent']:,}  expanded {per_token['expanded']:,}  "
          f"ratio {per_token['expanded'] / per_token['latent']:.2f}")
    print(f"tokens in {args.budget_gib:g} GiB: latent {budget // per_token['latent']:,}  "
          f"expanded {budget // per_token['expanded']:,}")

    torch.manual_seed(0)
    layer = MultiHeadLatentAttention(V2_LITE).cuda().to(torch.bfloat16).eval().requires_grad_(False)
    for param in layer.parameters():
        param.data.normal_(0, 0.02)
    scale = layer.scale
    rows = []
    print(f"{'batch':>6} {'context':>8} {'latent kernel ms':>17} {'expanded kernel ms':>19} {'ratio':>6} {'MLA layer ms':>13}")
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            block = 16
            width = -(-context // block)
            table = torch.arange(batch * width, dtype=torch.int32, device="cuda").view(batch, width)
            lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            cache_rows = (batch * width + 1) * block
            latent_cache = torch.randn(cache_rows, 1, latent + rope, device="cuda", dtype=torch.bfloat16)
            q_latent = torch.randn(batch, heads, latent + rope, device="cuda", dtype=torch.bfloat16)
            latent_ms = time_graph(lambda: paged_latent_decode_attention(
                q_latent, latent_cache, latent, table, lens, block, scale))
            del latent_cache
            cache_k = torch.randn(cache_rows, heads, nope + rope, device="cuda", dtype=torch.bfloat16)
            cache_v = torch.randn(cache_rows, heads, v_dim, device="cuda", dtype=torch.bfloat16)
            q = torch.randn(batch, heads, nope + rope, device="cuda", dtype=torch.bfloat16)
            expanded_ms = time_graph(lambda: paged_decode_attention(q, cache_k, cache_v, table, lens, block, scale))
            del cache_k, cache_v
            cache = KVCache([latent_layout], batch * width, torch.bfloat16, "cuda", block_size=block)
            positions = torch.full((batch,), context - 1, device="cuda")
            write = (table[:, -1].long() * block + (context - 1) % block)
            meta = AttentionBatch.for_decode(positions, write, table, lens, block)
            x = torch.randn(batch, V2_LITE["hidden_size"], device="cuda", dtype=torch.bfloat16)
            layer_ms = time_graph(lambda: layer(x, meta, *cache.layer(0)))
            del cache
            torch.cuda.empty_cache()
            rows.append(dict(batch=batch, context=context, latent_kernel_ms=latent_ms, expanded_kernel_ms=expanded_ms,
                             mla_layer_ms=layer_ms))
            print(f"{batch:>6} {context:>8} {latent_ms:>17.3f} {expanded_ms:>19.3f} {expanded_ms / latent_ms:>6.2f} {layer_ms:>13.3f}")
    write_json("mla_decode", dict(bytes_per_token=per_token, rows=rows))


if __name__ == "__main__":
    main()
