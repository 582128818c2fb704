"""How the MoE GEMM kernels (`moe_triton`) are launched: a table entry's settings checked and filled in,
the registers an FP8 tile holds, whether TMA works here, operands as TMA descriptors, and the grid.

No kernel lives here; `moe_triton` launches its two GEMMs through `launch`, and `bench/kernels/moe_tune.py` reads
the same checks when it sweeps the settings.
"""

from __future__ import annotations

import functools
import logging

import torch

from afd.kernels.fp8_gemm import GROUP
from afd.kernels.pdl import launch_options

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton < 3.3: pointer loads only
    TensorDescriptor = None
try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # no Triton: nothing is launched
    OutOfResources = ()

log = logging.getLogger(__name__)
_FITTING_STAGES: dict[tuple, int] = {}  # (kernel, settings, constants) → the pipeline depth that fits this GPU
REMOVED_KEYS = ("LAG", "K_PAIRS")  # FP8 kernel variants removed in issue 32 (wrong rows on the H200)


def kernel_settings(cfg: dict, layout_m: int, fp8: bool = False, kernel: str = "") -> dict:
    """One kernel's table entry with what older tables leave out filled in: its own BLOCK_M
    (default the layout's; it must divide it, so a tile still has one expert), GROUP_M (0: all
    tiles in one group, the column-major order of old), TMA (off), GATHER (off: gate_up
    gathers its rows itself; on: from a buffer filled first; `down` ignores it), ONE_DOT (off:
    gate_up loads and multiplies its gate and up blocks apart; on, with TMA only: as one; `down`
    ignores it), HALVES (off; on: gate_up makes a column block in two passes of one dot each over half its gate
    columns beside the same half's up columns, `moe_gate_up_halves`; not with ONE_DOT; `down` ignores it) and
    PERSISTENT (0: one program per job of the worst-case grid; n: n programs per multiprocessor loop over the used
    tiles' jobs) and MAX_REGS (0: ptxas' choice; n: at most n registers a thread, Triton's `maxnreg`, so that more
    programs share a multiprocessor: 168 lets three of 4 warps, 128 two of 8). FP8 (`fp8`) also needs BLOCK_K to
    divide 128 (a step stays in one scale group) and gate_up's BLOCK_N a multiple of 128 (act is quantized per 128
    columns there), 128 with HALVES (a half's 64 columns in one weight block).
    The keys of removed kernel variants (`REMOVED_KEYS`) are refused."""
    for key in REMOVED_KEYS:
        if key in cfg:
            raise ValueError(f"{kernel or 'MoE'} table entry has {key}: the FP8 {key} kernel variant was removed "
                             f"(issue 32: it wrote wrong rows on the H200); drop {key} or re-run bench/kernels/moe_tune.py")
    settings = {"BLOCK_M": layout_m, "GROUP_M": 0, "TMA": False, "GATHER": False, "ONE_DOT": False, "HALVES": False,
                "PERSISTENT": 0, "MAX_REGS": 0, **cfg}
    if settings["BLOCK_M"] < 16 or layout_m % settings["BLOCK_M"]:
        raise ValueError(f"kernel BLOCK_M {settings['BLOCK_M']} must be at least 16 and divide the layout's "
                         f"BLOCK_M {layout_m}; re-run bench/kernels/moe_tune.py or fix the table")
    if not isinstance(settings["PERSISTENT"], int) or settings["PERSISTENT"] < 0:
        raise ValueError(f"PERSISTENT {settings['PERSISTENT']!r} must be 0 (off) or programs per multiprocessor")
    max_regs = settings["MAX_REGS"]
    if not isinstance(max_regs, int) or isinstance(max_regs, bool) or not (max_regs == 0 or 24 <= max_regs <= 255):
        raise ValueError(f"MAX_REGS {settings['MAX_REGS']!r} must be 0 (ptxas' choice) or 24-255 registers a thread")
    if settings["ONE_DOT"] and not settings["TMA"]:
        raise ValueError("ONE_DOT loads gate and up blocks in one TMA box: it needs TMA on")
    if settings["HALVES"] and (settings["ONE_DOT"] or settings["BLOCK_N"] < 32 or settings["BLOCK_N"] % 32):
        raise ValueError(f"HALVES splits gate_up's column block in two: BLOCK_N {settings['BLOCK_N']} must be a "
                         "multiple of 32, and ONE_DOT off")
    if fp8 and kernel == "gate_up" and settings["HALVES"] and settings["BLOCK_N"] != GROUP:
        raise ValueError(f"FP8 gate_up with HALVES needs BLOCK_N {GROUP} (got {settings['BLOCK_N']})")
    if fp8 and (GROUP % settings["BLOCK_K"] or (kernel == "gate_up" and settings["BLOCK_N"] % GROUP)):
        raise ValueError(f"FP8 {kernel} settings BLOCK_K {settings['BLOCK_K']} / BLOCK_N {settings['BLOCK_N']}: "
                         f"BLOCK_K must divide {GROUP} (and gate_up's BLOCK_N be a multiple of {GROUP}); "
                         "re-run bench/kernels/moe_tune.py --fp8 or fix the table")
    return settings


def fp8_accumulator_registers(kernel: str, block_m: int, block_n: int, warps: int, one_dot: bool = False,
                              halves: bool = False) -> int:
    """float32 registers per thread an FP8 tile of `kernel` holds: its accumulators plus a step's product, which FP8
    cannot add in the dot (it is scaled first): down BM×BN twice; gate_up two BM×BN accumulators and one product,
    with ONE_DOT a BM×2BN accumulator and its product, with HALVES one BM×BN accumulator, its product and the
    first half's act (BM×BN/2). Of a thread's 255, well over half spills."""
    half_tiles = {"down": 4, "gate_up": 8 if one_dot else 5 if halves else 6}[kernel]
    return half_tiles * block_m * block_n // (64 * warps)


def tma_supported(device: torch.device) -> bool:
    """Whether TMA descriptors work here: Triton has them and the GPU is a Hopper or later
    (or Triton's CPU interpreter runs the kernels). Elsewhere a TMA setting falls back to pointers."""
    if TensorDescriptor is None:
        return False
    return device.type != "cuda" or _capability(device.index)[0] >= 9


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, per_multiprocessor: int) -> int:
    """A persistent grid's size (Triton's CPU interpreter: 4 per "multiprocessor" of one)."""
    return per_multiprocessor * (_multiprocessors(device.index) if device.type == "cuda" else 4)


def operand(tensor: torch.Tensor, block: list[int], tma: bool):
    """`tensor` as a 2-D TMA descriptor of `block` tiles, or itself for pointer loads."""
    if not tma:
        return tensor
    matrix = tensor.view(-1, tensor.shape[-1])
    return TensorDescriptor(matrix, list(matrix.shape), list(matrix.stride()), block)


def launch(kernel, args: tuple, rows: int, cols: int, layout_m: int, cfg: dict, device: torch.device, **constants):
    """One program per job of the worst-case grid, or a persistent grid (PROGRAMS is a compile-time
    constant: the device's, never the token count's, so no token count compiles a variant of its own).
    Returns Triton's compiled kernel (its `n_regs`, `n_spills`; None under the CPU interpreter). An entry whose
    shared memory this GPU cannot give (Triton's OutOfResources at its first launch, i.e. at warm-up) runs with one
    pipeline stage fewer at a time, logged once and remembered."""
    tiles = rows // cfg["BLOCK_M"]
    programs = _programs(device, cfg["PERSISTENT"]) if cfg["PERSISTENT"] else 0
    # almost always empty: the key is built only when a lowered entry may apply (not on every eager launch)
    stages = _FITTING_STAGES.get(_stages_key(kernel, cfg, constants), cfg["num_stages"]) if _FITTING_STAGES \
        else cfg["num_stages"]
    while True:
        try:
            return kernel[(min(programs, tiles * cols) if programs else tiles * cols,)](
                *args, layout_m, cfg["GROUP_M"] or tiles, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                BLOCK_K=cfg["BLOCK_K"], TMA=cfg["TMA"], PERSISTENT=bool(programs), PROGRAMS=programs,
                num_warps=cfg["num_warps"], num_stages=stages, **constants,
                **({"maxnreg": cfg["MAX_REGS"]} if cfg["MAX_REGS"] else {}),
                **launch_options(device, release_early=False))
        except OutOfResources as err:  # raised before the kernel runs (at its first launch: warm-up)
            if stages <= 1:
                raise
            key = _stages_key(kernel, cfg, constants)
            log.warning("%s with %s %s needs more than this GPU has (%s): running it with num_stages %d instead of "
                        "%d; re-run bench/kernels/moe_tune.py for this GPU", key[0], cfg, constants, err, stages - 1, stages)
            stages -= 1
            _FITTING_STAGES[key] = stages


def lowered_entries() -> int:
    """How many (kernel, entry, constants) have run with fewer pipeline stages than asked so far (`launch`): a tuner
    drops a candidate whose first launch added one (it would time another candidate's depth under its name)."""
    return len(_FITTING_STAGES)


def _stages_key(kernel, cfg: dict, constants: dict) -> tuple:
    """What `_FITTING_STAGES` remembers a lowered pipeline depth by: the kernel, its table entry, its constants."""
    return getattr(kernel, "__name__", repr(kernel)), tuple(sorted(cfg.items())), tuple(sorted(constants.items()))
