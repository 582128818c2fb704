"""`afd plan --fit`: what each rank of an AFDDeployment holds, from the checkpoint's config.json and the CR.

Sizes come from the runtime's own model code, not a formula: each role's share is built on the
meta device exactly as the loader builds it (pruned for the role, sharded for expert
parallelism, FP8 kept on GPUs where the checkpoint has it) and its tensors are counted. The
device memory is the GPU's (from `nvidia.com/gpu.product` in the role's nodeSelector, or
--gpu-memory-gib) or, without a GPU, the pod's memory limit. An attention rank's KV tokens are
what `gpuMemoryUtilization` of its device leaves after the weights and the graph margin
(the runtime then profiles activations, so this is an upper bound); an FFN shard that cannot hold
its share is refused with the arithmetic, one that leaves less than the margin is warned about.
KV bytes per token are those of the cache's dtype (`kvCacheDtype`: FP8 halves them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from afd.checkpoint_tools.fp8_convert import is_projection_weight
from afd.kv.budget import GRAPH_MARGIN_BYTES
from afd.kv.cache import KVCache
from afd.models.kv_dtype import cache_dtype
from afd.models.loader import build_share
from afd.models.quantization import parse_quantization

GIB = 1 << 30
# total memory CUDA reports, by the product name's key part (nvidia.com/gpu.product labels, e.g. NVIDIA-H200)
GPU_MEMORY_MIB = {"H200": 143771, "H100": 81559, "H800": 81559, "A100-SXM4-80GB": 81920, "A100-80GB": 81920,
                  "H20": 97871, "B200": 183359, "L40S": 46068, "A100": 40960}
_QUANTITY = re.compile(r"^(?P<number>[0-9.]+)(?P<unit>Ki|Mi|Gi|Ti|K|M|G|T)?$")
_UNITS = {None: 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


class FitError(ValueError):
    """A CR or config the sizing cannot read; the message names the field."""


@dataclass(frozen=True)
class Device:
    """The memory one rank's pod gets: a GPU's, or without one the pod's memory limit."""

    kind: str  # "gpu" or "cpu"
    name: str
    total_bytes: int


@dataclass(frozen=True)
class RankFit:
    """One kind of rank: what it holds and whether it fits its device."""

    role: str
    label: str
    pods: int
    weight_bytes: int
    scale_bytes: int
    device: Device
    usable_bytes: int  # gpuMemoryUtilization of the device (all of a CPU pod's limit)
    kv_bytes_per_token: int = 0
    kv_tokens: int = 0
    verdict: str = "fits"  # "fits", "tight" (warned) or "does not fit" (refused)
    arithmetic: str = ""


@dataclass(frozen=True)
class FitReport:
    model: str
    dtype: str
    fp8: bool
    ranks: list[RankFit]
    kv_cache_dtype: str = "auto"

    @property
    def refused(self) -> bool:
        return any(rank.verdict == "does not fit" for rank in self.ranks)


def quantity_bytes(value) -> int:
    """A Kubernetes quantity ("64Gi", "500M", 1024) in bytes."""
    match = _QUANTITY.match(str(value))
    if not match:
        raise FitError(f"memory quantity {value!r}: expected a number with an optional unit (Ki, Mi, Gi, ...)")
    return int(float(match["number"]) * _UNITS[match["unit"]])


def role_device(role_spec: dict, gpu_memory_bytes: int | None, role: str) -> Device:
    """The memory one pod of the role gets (see the module docstring)."""
    resources = role_spec.get("resources") or {}
    limits = resources.get("limits") or {}
    gpus = int(limits.get("nvidia.com/gpu", 0) or 0)
    if gpus:
        if gpus != 1:
            raise FitError(f"{role}.resources.limits['nvidia.com/gpu']={gpus}: a rank runs on one GPU")
        if gpu_memory_bytes:
            return Device("gpu", "GPU (--gpu-memory-gib)", gpu_memory_bytes)
        product = (role_spec.get("nodeSelector") or {}).get("nvidia.com/gpu.product", "")
        for key, mib in sorted(GPU_MEMORY_MIB.items(), key=lambda item: -len(item[0])):
            if key in product:
                return Device("gpu", product, mib << 20)
        raise FitError(f"{role}: which GPU? set nodeSelector nvidia.com/gpu.product (e.g. NVIDIA-H200) or "
                       "pass --gpu-memory-gib")
    memory = limits.get("memory") or resources.get("requests", {}).get("memory")
    if memory is None:
        raise FitError(f"{role}: no GPU and no memory limit to size against")
    return Device("cpu", "pod memory limit", quantity_bytes(memory))


def share_bytes(config: dict, role: str, gate_on_attention: bool, dtype, shard: tuple[int, int], keep_fp8: bool,
                kv_dtype=None):
    """(weight bytes, FP8 scale bytes, KV bytes per token in a cache of `kv_dtype` (None: `dtype`)) of one role's
    share, built on the meta device as the loader builds it."""
    fmt = parse_quantization(config)
    fp8_weights = None
    if fmt is not None and keep_fp8:
        def fp8_weights(key: str) -> bool:
            module = key.rsplit(".", 1)[0]
            return is_projection_weight(key) and not any(
                module == name or module.startswith(name + ".") for name in fmt.not_converted)
    model, _, _ = build_share(config, role, gate_on_attention, dtype, "meta", shard, fp8_weights)
    weights = scales = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        size = tensor.numel() * tensor.element_size()
        if name.endswith(("_scale_inv", "_scale")):
            scales += size
        else:
            weights += size
    kv = KVCache.bytes_per_token(model.kv_layouts(), kv_dtype or dtype) if role == "attention" else 0
    return weights, scales, kv


def fit(config: dict, cr: dict, gpu_memory_bytes: int | None = None, model_name: str = "") -> FitReport:
    """Size every kind of rank of the AFDDeployment `cr` for the checkpoint `config` (its config.json)."""
    spec = cr.get("spec") or {}
    afd = spec.get("afd") or {}
    attention, ffn = spec.get("attention") or {}, spec.get("ffn") or {}
    attention_device = role_device(attention, gpu_memory_bytes, "attention")
    ffn_device = role_device(ffn, gpu_memory_bytes, "ffn")
    dtype_name = afd.get("dtype", "auto")
    if dtype_name == "auto":
        dtype_name = "bfloat16" if attention_device.kind == "gpu" else "float32"
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise FitError(f"afd.dtype={dtype_name!r}: not a dtype")
    kv_name = afd.get("kvCacheDtype", "auto")
    try:
        kv_dtype = cache_dtype(kv_name, dtype)
    except ValueError as err:
        raise FitError(f"afd.kvCacheDtype: {err}") from None
    gate = bool(afd.get("computeGateOnAttention", False))
    utilization = float(afd.get("gpuMemoryUtilization", 0.9))
    kv_cache_bytes = int(afd.get("kvCacheBytes", 0) or 0)
    shards = int(ffn.get("expertParallel", 1) or 1)
    fp8 = parse_quantization(config) is not None
    ranks = [_attention_fit(config, gate, dtype, attention, attention_device, utilization, kv_cache_bytes, fp8,
                            GRAPH_MARGIN_BYTES, int(afd.get("maxModelLen", 0) or 0), kv_dtype)]
    for shard in sorted({0, shards - 1}):  # shard 0 also holds the dense layers: the largest
        ranks.append(_ffn_fit(config, gate, dtype, ffn, ffn_device, utilization, fp8, (shard, shards),
                              GRAPH_MARGIN_BYTES))
    return FitReport(model_name or config.get("model_type", "?"), dtype_name, fp8, ranks, kv_name)


def _usable(device: Device, utilization: float) -> int:
    return int(device.total_bytes * utilization) if device.kind == "gpu" else device.total_bytes


def _attention_fit(config, gate, dtype, role_spec, device, utilization, kv_cache_bytes, fp8, margin, max_model_len,
                   kv_dtype=None):
    weights, scales, per_token = share_bytes(config, "attention", gate, dtype, (0, 1), fp8 and device.kind == "gpu",
                                             kv_dtype)
    usable = _usable(device, utilization)
    held = weights + scales
    if kv_cache_bytes:
        left, how = kv_cache_bytes, f"kvCacheBytes {kv_cache_bytes / GIB:.2f} GiB"
        over = held + kv_cache_bytes > device.total_bytes
    else:
        reserve = margin if device.kind == "gpu" else 0
        left = max(usable - held - reserve, 0) if device.kind == "gpu" else GIB
        how = (f"{utilization:.2f} x {device.total_bytes / GIB:.1f} GiB - {held / GIB:.2f} GiB held - "
               f"{reserve / GIB:.2f} GiB graph margin = {left / GIB:.2f} GiB" if device.kind == "gpu"
               else "1 GiB (the CPU default)")
        over = held > usable
    tokens = left // per_token if per_token else 0
    arithmetic = f"KV: {how} / {per_token} B per token = {tokens:,} tokens"
    verdict = "fits"
    if over or tokens == 0:
        verdict = "does not fit"
        arithmetic = (f"{held / GIB:.2f} GiB held leaves no KV cache on {device.total_bytes / GIB:.1f} GiB; "
                      + arithmetic)
    elif max_model_len and tokens < max_model_len:
        verdict, arithmetic = "does not fit", arithmetic + f" < maxModelLen {max_model_len:,}"
    pods = int(role_spec.get("ranks", 1))
    return RankFit("attention", "attention rank", pods, weights, scales, device, usable, per_token, tokens, verdict,
                   arithmetic)


def _ffn_fit(config, gate, dtype, role_spec, device, utilization, fp8, shard, margin):
    weights, scales, _ = share_bytes(config, "ffn", gate, dtype, shard, fp8 and device.kind == "gpu")
    usable = _usable(device, utilization)
    held = weights + scales
    reserve = margin if device.kind == "gpu" else 0
    label = f"ffn shard {shard[0]} of {shard[1]}" if shard[1] > 1 else "ffn rank"
    arithmetic = (f"{weights / GIB:.2f} GiB weights + {scales / GIB:.3f} GiB scales + {reserve / GIB:.2f} GiB margin "
                  f"= {(held + reserve) / GIB:.2f} GiB")
    if held > device.total_bytes:
        verdict = "does not fit"
        arithmetic += f" > {device.total_bytes / GIB:.1f} GiB of the {device.name}"
    elif held + reserve > usable:
        verdict = "tight"
        arithmetic += f" > {usable / GIB:.1f} GiB usable ({utilization:.2f} of {device.total_bytes / GIB:.1f} GiB)"
    else:
        verdict = "fits"
        arithmetic += f" <= {usable / GIB:.1f} GiB usable"
    pods = int(role_spec.get("ranks", 1))  # pods holding this shard (one per FFN rank)
    return RankFit("ffn", label, pods, weights, scales, device, usable, verdict=verdict, arithmetic=arithmetic)


def size(count: int) -> str:
    """Bytes in the largest binary unit that keeps a digit before the point."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


def render_fit(report: FitReport) -> str:
    """The sizing table (Markdown) and one line per rank kind with its arithmetic."""
    kv = ", FP8 KV cache" if report.kv_cache_dtype == "fp8" else ""
    lines = [f"{report.model}: {report.dtype}{', FP8 weights kept FP8 on GPUs' if report.fp8 else ''}{kv}", "",
             "| rank | pods | weights | FP8 scales | device | usable | KV tokens | verdict |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for rank in report.ranks:
        kv = f"{rank.kv_tokens:,}" if rank.role == "attention" else "-"
        lines.append(f"| {rank.label} | {rank.pods} | {size(rank.weight_bytes)} | {size(rank.scale_bytes)} | "
                     f"{size(rank.device.total_bytes)} | {size(rank.usable_bytes)} | {kv} | {rank.verdict} |")
    lines.append("")
    lines += [f"- {rank.label}: {rank.arithmetic}" for rank in report.ranks]
    return "\n".join(lines)
