"""The small-token MoE path (`afd.kernels.moe_small`: two GEMV launches, no alignment, no slot sum) equals the
aligned Triton path (`moe.experts_triton` with `AFD_MOE_SMALL_TOKENS=0`), with the same rounding of each row.

The kernel tests run on a GPU in bf16, or in Triton's CPU interpreter (TRITON_INTERPRET=1 before Triton is
imported: `make test-kernels`) in float16; otherwise they skip. The setting and dispatch tests need only Triton
importable, the compile test Triton's NVIDIA backend (no GPU, not the interpreter); the sample-shape comparison
needs a CUDA GPU.
"""

import importlib.util

import pytest
import torch

from afd.config import ConfigError, process_setting
from afd.kernels.fp8_blocks import quantize_block_fp8
from tests.kernel_device import KERNEL_DTYPES, NO_KERNEL_DEVICE, kernel_device

DEVICE = kernel_device()
DTYPE = KERNEL_DTYPES.get(DEVICE)
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=NO_KERNEL_DEVICE)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (tokens, top_k, shared): 1-4 tokens, 0-2 shared experts, routed slots or none (an EP shard's shared-only call)
ROUTINGS = [(1, 3, 2), (2, 3, 0), (3, 0, 1), (4, 3, 1), (1, 0, 2), (4, 2, 2)]


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.double() - reference.double()).norm() / reference.double().norm())


def aligned(monkeypatch, *args):
    """`moe.experts_triton` on the aligned path (alignment, two GEMMs, slot sum) with the default tables."""
    from afd.kernels import moe

    fp8 = args[3].dtype == torch.float8_e4m3fn
    monkeypatch.setenv("AFD_MOE_SMALL_TOKENS", "0")
    monkeypatch.setattr(moe, "device_table", lambda *_: {1: (moe.FP8_DEFAULT_CONFIGS if fp8 else moe.DEFAULT_CONFIGS)[1]})
    return moe.experts_triton(*args)


def routing(tokens: int, routed: int, top_k: int, generator: torch.Generator):
    """(weights of DTYPE, int64 ids) of a greedy top-k over random scores; [T, 0] for k = 0."""
    weights, ids = torch.rand(tokens, routed, generator=generator).topk(top_k, dim=-1)
    return weights.to(DTYPE).to(DEVICE), ids.to(DEVICE)


def bf16_experts(experts: int, hidden: int, inter: int, generator: torch.Generator):
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=generator) * 0.1).to(DTYPE).to(DEVICE)
    down = (torch.randn(experts, hidden, inter, generator=generator) * 0.1).to(DTYPE).to(DEVICE)
    return gate_up, down, None, None


def fp8_experts(experts: int, hidden: int, inter: int, generator: torch.Generator):
    """(gate_up, down, gate_up_scale, down_scale) of random block-varied FP8 experts (test_moe_fp8's)."""
    from tests.runtime.test_moe_fp8 import blocky

    gate_up, gate_up_scale = quantize_block_fp8(blocky(experts, 2 * inter, hidden, generator=generator) * 0.05)
    down, down_scale = quantize_block_fp8(blocky(experts, hidden, inter, generator=generator) * 0.05)
    return tuple(t.to(DEVICE) for t in (gate_up, down, gate_up_scale, down_scale))


@needs_kernels
@pytest.mark.parametrize("sum_dtype", [None, torch.float32], ids=["x-dtype", "float32"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tokens,top_k,shared", ROUTINGS)
def test_the_small_path_equals_the_aligned_path(tokens, top_k, shared, fp8, sum_dtype, monkeypatch):
    """FP8: hidden 320 (a partial scale block, a partial 256-input step), width 256 (two act groups); else a
    width that no block divides."""
    from afd.kernels.moe_small import experts_small

    routed = 6
    hidden, inter = (320, 256) if fp8 else (96, 48)
    generator = torch.Generator().manual_seed(tokens * 10 + top_k + shared)
    gate_up, down, gate_up_scale, down_scale = (fp8_experts if fp8 else bf16_experts)(routed + shared, hidden, inter,
                                                                                       generator)
    x = (torch.randn(tokens, hidden, generator=generator) * 2).to(DTYPE).to(DEVICE)
    weights, ids = routing(tokens, routed, top_k, generator)
    args = (x, weights, ids, gate_up, down, shared, sum_dtype, gate_up_scale, down_scale)
    out = experts_small(*args)
    reference = aligned(monkeypatch, *args)
    assert out.dtype == reference.dtype == (sum_dtype or DTYPE) and out.shape == (tokens, hidden)
    assert relative_error(out, reference) < (1e-2 if fp8 else 2e-3)  # FP8: a few e4m3 roundings may differ


@needs_kernels
@pytest.mark.parametrize("fp8,labels", [
    (False, ("n128k256w4s1", "n32k512w4s2")), (False, ("n32k128w2s3", "n2k256w8s1")),
    (False, ("n8k64w4s4", "n1k128w4s4")),
    (True, ("n128k128w4s1", "n64k128w4s2")), (True, ("n32k128w2s3", "n2k128w8s1")),
    (True, ("n16k128w4s4", "n2k128w4s4")),
], ids=["bf16-wide", "bf16-narrow", "bf16-deep", "fp8-act-quantized-in-gate-up", "fp8-act-quantized-in-down",
        "fp8-deep"])
def test_every_block_setting_gives_the_same_result(labels, fp8, monkeypatch):
    """FP8 act is quantized in gate_up's epilogue when its column block is 128, else in down as it reads act: the
    same values either way; pipelined loads (num_stages > 1) or not, one step or several."""
    from afd.kernels.moe_small import experts_small, parse_settings

    settings = parse_settings(*labels)

    tokens, routed, top_k, shared, hidden, inter = 3, 6, 2, 1, 320, 384
    generator = torch.Generator().manual_seed(7)
    gate_up, down, gate_up_scale, down_scale = (fp8_experts if fp8 else bf16_experts)(routed + shared, hidden, inter,
                                                                                       generator)
    x = (torch.randn(tokens, hidden, generator=generator) * 2).to(DTYPE).to(DEVICE)
    weights, ids = routing(tokens, routed, top_k, generator)
    args = (x, weights, ids, gate_up, down, shared, None, gate_up_scale, down_scale)
    out = experts_small(*args, settings=settings)
    assert relative_error(out, aligned(monkeypatch, *args)) < (1e-2 if fp8 else 2e-3)


def exact_case(tokens: int, top_k: int, shared: int, routed: int = 6, hidden: int = 64, inter: int = 48,
               tiny_shared: bool = False):
    """Inputs whose every product and float32 sum is exact, so both paths must give one result bit for bit: x and
    the weights small integers, down's entries multiples of 1/64, every gate ≥ 20 (SiLU(g) == g in float32).
    `tiny_shared`: the first shared expert's down times 2^-12 (its rows still exact), so that adding the slot rows
    in float32 rounds: the order of the sum shows. Returns (x, weights, ids, gate_up, down) on the CPU and, per token,
    the slot rows in float32."""
    generator = torch.Generator().manual_seed(100 * tokens + 10 * top_k + shared)
    experts = routed + shared
    x = torch.randint(-1, 2, (tokens, hidden), generator=generator).float()
    x[:, 0] = torch.randint(1, 3, (tokens,), generator=generator).float()
    gate_up = torch.randint(-1, 2, (experts, 2 * inter, hidden), generator=generator).float()
    gate_up[:, :inter] *= torch.rand(experts, inter, hidden, generator=generator) < 0.2  # sparse gate rows
    gate_up[:, :inter, 0] = 32
    down = torch.randint(-63, 64, (experts, hidden, inter), generator=generator).float() / 64
    scale = torch.ones(experts, 1, 1)
    if tiny_shared:
        scale[routed] = 2 ** -12
    down *= scale
    scores = torch.rand(tokens, routed, generator=generator)
    weights, ids = scores.topk(top_k, dim=-1)
    weights = weights.to(DTYPE)  # 8–11 significant bits: a row times its weight needs more than DTYPE holds
    all_ids = torch.cat((ids, torch.arange(routed, experts).expand(tokens, shared)), 1)
    rows = []
    for token in range(tokens):
        h = gate_up[all_ids[token]].double() @ x[token].double()  # [slots, 2I]
        gate, up = h[:, :inter], h[:, inter:]
        assert bool((gate >= 20).all())  # the design: SiLU(gate) == gate in float32
        act = (gate * up).float().to(DTYPE).double()  # act is stored in DTYPE
        terms = act[:, None, :] * down[all_ids[token]].double()  # [slots, H, I]
        # every partial sum a multiple of 1/64 below 2^17 (both × the expert's scale): exact
        assert bool((terms.abs().sum(-1) < 2 ** 17 * scale[all_ids[token]][:, :, 0]).all())
        rows.append(terms.sum(-1).float())
    return x.to(DTYPE), weights, ids, gate_up.to(DTYPE), down.to(DTYPE), rows


def summed(rows, weights, top_k: int, round_routed: bool = True, round_shared: bool = False,
           reverse: bool = False) -> torch.Tensor:
    """[T, H] float32: each token's slot rows, routed ones times their weight (float32) and rounded to DTYPE, added
    in float32 in slot order (`reverse`: last slot first)."""
    out = []
    for token, token_rows in enumerate(rows):
        total = torch.zeros(token_rows.shape[1])
        order = list(enumerate(token_rows))
        for slot, row in reversed(order) if reverse else order:
            if slot < top_k:
                row = row * weights[token, slot].float()
            if round_routed if slot < top_k else round_shared:
                row = row.to(DTYPE).float()
            total = total + row
        out.append(total)
    return torch.stack(out)


@needs_kernels
@pytest.mark.parametrize("sum_dtype", [None, torch.float32], ids=["x-dtype", "float32"])
@pytest.mark.parametrize("tokens,top_k,shared", [(1, 3, 2), (4, 3, 1), (2, 3, 0), (3, 0, 2)])
def test_both_paths_round_each_row_as_documented(tokens, top_k, shared, sum_dtype, monkeypatch):
    """Bit for bit: a routed pair's weighted row rounded to x's dtype, a shared expert's kept in float32, the sum in
    float32 slot by slot, rounded once to `sum_dtype`; the inputs are chosen so that any other rounding differs."""
    from afd.kernels.moe_small import experts_small

    x, weights, ids, gate_up, down, rows = exact_case(tokens, top_k, shared)
    expected = summed(rows, weights, top_k).to(sum_dtype or DTYPE)
    if sum_dtype is torch.float32:  # the case tells the documented rounding from the others
        assert top_k == 0 or not torch.equal(expected, summed(rows, weights, top_k, round_routed=False))
        assert not shared or not torch.equal(expected, summed(rows, weights, top_k, round_shared=True))
    args = [t.to(DEVICE) for t in (x, weights, ids, gate_up, down)]
    assert torch.equal(experts_small(*args, shared, sum_dtype).cpu(), expected)
    assert torch.equal(aligned(monkeypatch, *args, shared, sum_dtype).cpu(), expected)


@needs_kernels
@pytest.mark.parametrize("tokens,top_k,shared", [(1, 3, 2), (4, 2, 2), (2, 0, 3)])
def test_both_paths_add_the_slots_in_order(tokens, top_k, shared, monkeypatch):
    """Bit for bit, where float32 sums across slots round (one shared expert's rows 2^-12 times the others'): the
    rows added slot 0 first, one at a time (the small path's down kernel holds all the slots' rows at once)."""
    from afd.kernels.moe_small import experts_small

    x, weights, ids, gate_up, down, rows = exact_case(tokens, top_k, shared, tiny_shared=True)
    expected = summed(rows, weights, top_k)
    assert not torch.equal(expected, summed(rows, weights, top_k, reverse=True))  # the order shows
    args = [t.to(DEVICE) for t in (x, weights, ids, gate_up, down)]
    assert torch.equal(experts_small(*args, shared, torch.float32).cpu(), expected)
    assert torch.equal(aligned(monkeypatch, *args, shared, torch.float32).cpu(), expected)


@needs_kernels
def test_bad_input_is_refused():
    from afd.kernels.moe_small import MAX_TOKENS, experts_small, parse_settings

    generator = torch.Generator().manual_seed(0)
    gate_up, down, gate_up_scale, down_scale = fp8_experts(3, 256, 128, generator)
    x = torch.zeros(MAX_TOKENS + 1, 256, dtype=DTYPE, device=DEVICE)
    weights, ids = routing(MAX_TOKENS + 1, 2, 1, generator)
    with pytest.raises(ValueError, match=f"at most {MAX_TOKENS} tokens, got {MAX_TOKENS + 1}"):
        experts_small(x, weights, ids, gate_up, down, 1, None, gate_up_scale, down_scale)
    x, weights, ids = x[:2], weights[:2], ids[:2]
    with pytest.raises(ValueError, match=r"need I % 128 == 0, gate_up_scale \(3, 2, 2\)"):
        experts_small(x, weights, ids, gate_up, down, 1, None, gate_up_scale[:, :1], down_scale)
    with pytest.raises(ValueError, match="both block scales"):
        experts_small(x, weights, ids, gate_up, down, 1, None, gate_up_scale, None)
    with pytest.raises(ValueError, match=r"want x \[T, H\]"):
        experts_small(x[:, :128], weights, ids, gate_up, down, 1, None, gate_up_scale, down_scale)
    for labels, message in [(("n16k256w4s3", "n4k128w4s3"), "BLOCK_K must be 128"),
                            (("n16k128w4s3", "n256k128w4s3"), "BLOCK_N at most 128"),
                            (("n24k128w4s3", "n4k128w4s3"), "powers of two"),
                            (("n16k128w4s9", "n4k128w4s3"), "num_stages 1-8")]:
        with pytest.raises(ValueError, match=message):
            experts_small(x, weights, ids, gate_up, down, 1, None, gate_up_scale, down_scale,
                          settings=parse_settings(*labels))
    with pytest.raises(ValueError, match="exactly BLOCK_N, BLOCK_K, num_warps, num_stages"):
        experts_small(x, weights, ids, gate_up, down, 1, None, gate_up_scale, down_scale,
                      settings={"gate_up": {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4},
                                "down": {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4}})
    with pytest.raises(ValueError, match="looks like n16k256w4s3"):
        parse_settings("n16k256w4", "n4k128w4s3")


@needs_triton
def test_the_shipped_settings_pass_their_checks_and_labels_round_trip():
    """One setting per dtype serves every token count; a label reads and writes back unchanged."""
    from afd.kernels import moe_small

    for fp8 in (False, True):
        moe_small.check_settings(moe_small.SETTINGS[fp8], fp8)
    assert moe_small.label(moe_small.parse_label("n16k256w8s6")) == "n16k256w8s6"


@needs_triton
def test_the_threshold_setting_is_eight_by_default_and_bounded_by_the_path():
    from afd.config.process import SMALL_MOE_MAX_TOKENS
    from afd.kernels.moe_small import MAX_TOKENS

    assert SMALL_MOE_MAX_TOKENS == MAX_TOKENS
    assert process_setting("AFD_MOE_SMALL_TOKENS", {}) == 8  # by measurement (session 45, H100)
    assert process_setting("AFD_MOE_SMALL_TOKENS", {"AFD_MOE_SMALL_TOKENS": "4"}) == 4
    for raw in (str(MAX_TOKENS + 1), "-1", "few"):
        with pytest.raises(ConfigError, match=f"^AFD_MOE_SMALL_TOKENS='{raw}'"):
            process_setting("AFD_MOE_SMALL_TOKENS", {"AFD_MOE_SMALL_TOKENS": raw})


@needs_triton
@pytest.mark.parametrize("setting,tokens,fp8,path", [
    ("", 1, False, "small"), ("", 8, False, "small"), ("", 9, False, "aligned"), ("0", 1, False, "aligned"),
    ("2", 1, False, "small"), ("2", 2, False, "small"), ("2", 3, False, "aligned"), ("4", 0, False, "aligned"),
    ("", 1, True, "aligned"),
])
def test_experts_triton_takes_the_small_path_up_to_the_setting(setting, tokens, fp8, path, monkeypatch):
    """Which path `experts_triton` takes (neither runs: each stands in by naming itself); FP8 experts always take
    the aligned one."""
    from afd.kernels import moe, moe_align, moe_small

    class Took(Exception):
        pass

    def small(*args):
        raise Took("small")

    def align(*args):
        raise Took("aligned")

    monkeypatch.setenv("AFD_MOE_SMALL_TOKENS", setting)
    monkeypatch.setattr(moe_small, "experts_small", small)
    monkeypatch.setattr(moe_align, "align", align)
    monkeypatch.setattr(moe, "device_table", lambda *_: moe.DEFAULT_CONFIGS)
    ids = torch.zeros(tokens, 2, dtype=torch.int64)
    if fp8:  # e4m3 stacks with their 128 x 128 block scales
        experts = (torch.zeros(4, 256, 128).to(torch.float8_e4m3fn), torch.zeros(4, 128, 128).to(torch.float8_e4m3fn),
                   0, None, torch.ones(4, 2, 1), torch.ones(4, 1, 1))
        x = torch.zeros(tokens, 128)
    else:
        experts, x = (torch.zeros(4, 96, 64), torch.zeros(4, 64, 48)), torch.zeros(tokens, 64)
    with pytest.raises(Took, match=f"^{path}$"):
        moe.experts_triton(x, torch.ones(tokens, 2), ids, *experts)


def compile_for_hopper(fn, signature: dict, constants: dict, warps: int, stages: int = 3):
    """(registers, stack bytes) a thread of `fn` takes, compiled for sm_90 by this Triton (no GPU needed): pointers
    and the hidden and intermediate sizes marked 16-divisible, as the launcher marks real ones."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
             if kind.startswith("*") or name in ("hidden", "inter")}
    source = ASTSource(fn, {**signature, **{name: "constexpr" for name in constants}}, constants, attrs)
    options = {"num_warps": warps, "num_stages": stages}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(kernel.asm["cubin"])
        file.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True,
                               check=True).stdout
    return tuple(int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))


def hopper_compiler_missing() -> bool:
    import os

    spec = importlib.util.find_spec("triton")
    if spec is None or os.environ.get("TRITON_INTERPRET") == "1":
        return True
    from pathlib import Path

    return not (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump").is_file()


def hopper_usage(cfg: dict, fp8: bool, top_k: int, shared: int) -> dict:
    """kernel → (registers, stack bytes) of both kernels at `cfg` (`moe_small.SETTINGS`' form), compiled for sm_90."""
    import triton

    from afd.kernels import moe_small

    up_cfg, down_cfg = cfg["gate_up"], cfg["down"]
    act_fp8 = fp8 and up_cfg["BLOCK_N"] % 128 == 0
    weight, act = ("*fp8e4nv", "*fp8e4nv" if act_fp8 else "*fp32") if fp8 else ("*bf16", "*bf16")
    sizes = {"hidden": "i32", "inter": "i32", "num_routed": "i32"}
    up = compile_for_hopper(
        moe_small._gate_up_kernel, {"x": "*bf16", "ids": "*i64", "w": weight, "act": act, "w_scale": "*fp32",
                                    "act_scale": "*fp32", **sizes},
        dict(SLOTS=top_k + shared, TOP_K=top_k, BLOCK_N=up_cfg["BLOCK_N"], BLOCK_K=up_cfg["BLOCK_K"],
             STAGES=up_cfg["num_stages"], FP8=fp8, ACT_FP8=act_fp8), up_cfg["num_warps"], up_cfg["num_stages"])
    down = compile_for_hopper(
        moe_small._down_sum_kernel, {"act": act, "act_scale": "*fp32", "ids": "*i64", "weights": "*bf16", "w": weight,
                                     "w_scale": "*fp32", "x": "*bf16", "out": "*fp32", **sizes},
        dict(TOP_K=top_k, SHARED=shared, SLOTS_P2=triton.next_power_of_2(top_k + shared), BLOCK_N=down_cfg["BLOCK_N"],
             BLOCK_K=down_cfg["BLOCK_K"], STAGES=down_cfg["num_stages"], FP8=fp8, ACT_FP8=act_fp8),
        down_cfg["num_warps"], down_cfg["num_stages"])
    return {"gate_up": up, "down": down}


@pytest.mark.skipif(hopper_compiler_missing(), reason="needs Triton's NVIDIA backend (ptxas, cuobjdump), not the "
                    "interpreter")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("top_k,shared", [(6, 2), (8, 1), (0, 1)])
def test_the_kernels_compile_for_hopper_without_spilling(fp8, top_k, shared):
    """The interpreter runs what a GPU compiler may refuse: both kernels at every default setting compile for an
    H100/H200, and keep every value in registers (no stack: spills); 8 + 1 slots: down's widest tile (16 slots)."""
    from afd.kernels import moe_small

    usage = hopper_usage(moe_small.SETTINGS[fp8], fp8, top_k, shared)
    assert all(stack == 0 and 0 < regs <= 255 for regs, stack in usage.values()), usage


SAMPLE_SHAPES = {  # (routed, shared, top_k, hidden, inter, fp8): bench/harness/shapes.py's MOE_SHAPES; DeepSeek-V3 with 32
    # of its 256 routed experts (its hidden size and width, FP8; the kernels see only those)
    "deepseek-v2-lite": (64, 2, 6, 2048, 1408, False),
    "qwen3-30b-a3b": (128, 0, 8, 2048, 768, False),
    "deepseek-v3-fp8": (32, 1, 8, 7168, 2048, True),
}


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", sorted(SAMPLE_SHAPES))
def test_both_paths_agree_at_the_sample_shapes_on_a_gpu(shape, tokens, monkeypatch):
    """bf16 on the GPU, the tuned tables where they exist: the small path against the aligned one (FP8 too, which
    `experts_triton` keeps on the aligned path: the small one called itself)."""
    from afd.kernels import moe
    from afd.kernels.moe_small import experts_small

    routed, shared, top_k, hidden, inter, fp8 = SAMPLE_SHAPES[shape]
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    experts = routed + shared
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=generator, dtype=torch.bfloat16)
    down = torch.randn(experts, hidden, inter, device="cuda", generator=generator, dtype=torch.bfloat16)
    scales = (None, None)
    if fp8:  # e4m3 weights of unit magnitude, block scales of ~1/64
        gate_up, down = gate_up.to(torch.float8_e4m3fn), down.to(torch.float8_e4m3fn)
        scales = tuple(torch.rand(experts, rows // 128, cols // 128, device="cuda", generator=generator) / 32
                       for rows, cols in ((2 * inter, hidden), (hidden, inter)))
    else:
        gate_up, down = gate_up * 0.02, down * 0.02
    x = torch.randn(tokens, hidden, device="cuda", generator=generator, dtype=torch.bfloat16)
    weights, ids = torch.rand(tokens, routed, device="cuda", generator=generator).topk(top_k, dim=-1)
    args = (x, weights.bfloat16(), ids, gate_up, down, shared, None, *scales)
    monkeypatch.setenv("AFD_MOE_SMALL_TOKENS", "0")
    reference = moe.experts_triton(*args)
    out = experts_small(*args)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, hidden)
    assert relative_error(out, reference) < (1e-2 if fp8 else 2e-3)
