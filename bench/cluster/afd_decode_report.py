"""The tables of `afd_decode.py`: (b) decode step, (c) in-step transfer, (e) 2A1F; pure functions of its results."""

from __future__ import annotations

import json
import statistics


def _median(values):
    return statistics.median(values) if values else float("nan")


def transfer_split(attn_profiles, ffn_profiles) -> dict:
    """Per-layer one-way in-step transfer µs: (attention recv(L) - FFN compute(L)) / 2, stages=1 steps."""
    one_way, recv, compute = [], [], []
    for attn, ffn in zip(attn_profiles, ffn_profiles):
        a = {layer: s for kind, layer, s in attn if kind == "recv"}
        f = {layer: s for kind, layer, s in ffn if kind == "compute"}
        for layer in sorted(set(a) & set(f)):
            recv.append(a[layer] * 1e6)
            compute.append(f[layer] * 1e6)
            one_way.append((a[layer] - f[layer]) / 2 * 1e6)
    return {"one_way_us": _median(one_way), "attn_recv_us": _median(recv), "ffn_compute_us": _median(compute), "samples": len(one_way)}


def report(args, r: dict) -> dict:
    rows, hidden = [], 2048
    print(f"\nDeepSeek-V2-Lite shape, {args.layers} layers (first dense), random bf16, context {args.context}, "
          f"median of {args.steps} steps; AFD = 1A1F over NCCL, gate on FFN, CUDA graphs on both sides")
    print("\n(b) decode step: AFD (stages=2, DBO) on 2 GPUs vs monolithic on 1 GPU")
    print(f"{'batch':>5} {'mono ms':>8} {'mono tok/s/GPU':>15} {'AFD ms':>7} {'AFD tok/s/GPU':>14} {'attn-only ms':>13} "
          f"{'ffn-only ms':>12} {'overlap eff':>12} {'AFD s=1 ms':>11} {'AFD min192 ms':>14}")
    for batch in args.batches:
        mono, afd = r.get(f"mono/{batch}", {}).get("ms"), r.get(f"afd/A/{batch}", {}).get("ms")
        attn, ffn = r.get(f"attn_only/s2/{batch}", {}).get("ms"), r.get(f"ffn_only/s2/{batch}")
        afd1 = r.get(f"afd/B/{batch}", {}).get("ms")
        auto = r.get(f"afd/D/{batch}", {}).get("ms")
        row = {"batch": batch, "mono_ms": mono, "afd_ms": afd, "attn_only_ms": attn, "ffn_only_ms": ffn, "afd_stages1_ms": afd1, "afd_dbo_min_ms": auto,
               "attn_only_stages1_ms": r.get(f"attn_only/s1/{batch}", {}).get("ms"), "ffn_only_stages1_ms": r.get(f"ffn_only/s1/{batch}")}
        row["mono_tok_s_gpu"] = batch / mono * 1e3 if mono else None
        row["afd_tok_s_gpu"] = batch / afd * 1e3 / 2 if afd else None
        row["overlap_eff"] = max(attn, ffn) / afd if afd and attn and ffn else None
        rows.append(row)
        f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        print(f"{batch:>5} {f(mono):>8} {f(row['mono_tok_s_gpu'], 0):>15} {f(afd):>7} {f(row['afd_tok_s_gpu'], 0):>14} "
              f"{f(attn):>13} {f(ffn):>12} {f(row['overlap_eff']):>12} {f(afd1):>11} {f(auto):>14}")

    print("\n(c) per-layer transfer inside a step (phase B, stages=1, profiled eager steps) vs bare NCCL ping-pong, same run")
    print(f"{'rows':>5} {'KiB':>6} {'in-step one-way us':>19} {'attn recv(L) us':>16} {'ffn compute(L) us':>18} {'bare one-way us':>16}")
    transfers = []
    ffn_profiles = r.get("ffn_phase/B", {}).get("profiles", [])
    offset = 0
    for batch in args.batches:
        attn = r.get(f"profile/B/{batch}", [])
        split = transfer_split(attn, ffn_profiles[offset: offset + len(attn)])
        offset += len(attn)
        bare = r.get("bare_attn_side", {}).get(batch)
        transfers.append({"rows": batch, "bytes": batch * hidden * 2, **split, "bare_one_way_us": bare})
        print(f"{batch:>5} {batch * hidden * 2 / 1024:>6.0f} {split['one_way_us']:>19.1f} {split['attn_recv_us']:>16.1f} "
              f"{split['ffn_compute_us']:>18.1f} {bare if bare is not None else float('nan'):>16.1f}")
    print("bare ping-pong one-way us by rows (attention side):", {k: round(v, 1) for k, v in r.get("bare_attn_side", {}).items()})
    dbo_wait = {}
    for batch in args.batches:
        profs = r.get(f"profile/A/{batch}", [])
        dbo_wait[batch] = _median([s * 1e6 for p in profs for kind, _, s in p if kind == "recv"])
    print("phase A (stages=2) attention recv wait per layer x stage, median us:", {k: round(v, 1) for k, v in dbo_wait.items()})

    print("\n(e) 2A1F (two attention ranks on GPU 0, FFN aggregates both in one step) vs 1A1F, same total batch, stages=2, graphs")
    print(f"{'total batch':>11} {'1A1F ms':>8} {'1A1F tok/s':>11} {'2A1F ms r0/r1':>15} {'2A1F tok/s':>11} {'ratio':>6}")
    two = []
    for batch in args.batches:
        one = r.get(f"afd/A/{batch}", {}).get("ms")
        r0, r1 = r.get(f"afd/C/{batch}/0", {}).get("ms"), r.get(f"afd/C/{batch}/1", {}).get("ms")
        step = max(r0, r1) if r0 and r1 else None
        entry = {"batch": batch, "one_a_ms": one, "two_a_ms": [r0, r1], "one_a_tok_s": batch / one * 1e3 if one else None,
                 "two_a_tok_s": batch / step * 1e3 if step else None}
        entry["ratio"] = entry["two_a_tok_s"] / entry["one_a_tok_s"] if step and one else None
        two.append(entry)
        f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        print(f"{batch:>11} {f(one):>8} {f(entry['one_a_tok_s'], 0):>11} {f(r0) + '/' + f(r1):>15} {f(entry['two_a_tok_s'], 0):>11} {f(entry['ratio']):>6}")
    checks = {k: v for k, v in r.items() if k.startswith(("attn_phase", "mono_replays", "afd_graph_mib"))}
    checks.update({k: {kk: vv for kk, vv in v.items() if kk != "profiles"} for k, v in r.items() if k.startswith("ffn_phase")})
    print("\ngraph use:", json.dumps(checks))
    print("link close (Goodbye + ncclCommDestroy, bounded at 5 s) s:", {k: round(v, 2) for k, v in r.items() if k.startswith("close_s")})
    return {"args": {k: v for k, v in vars(args).items() if k not in ("ports",)}, "decode": rows, "transfer": transfers,
            "dbo_recv_wait_us": dbo_wait, "two_a_one_f": two, "graph_use": checks, "raw": {k: v for k, v in r.items() if not k.startswith(("profile", "ffn_phase"))}}
