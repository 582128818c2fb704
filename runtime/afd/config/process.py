"""The few `AFD_*` variables a process reads outside its `AFDConfig` (a kernel choice, a library path, the
log level): declared in `PROCESS_VARIABLES`, read only through `process_setting`. Torch-free.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from afd.config.declare import ConfigError, parse_bool


@dataclass(frozen=True)
class ProcessVariable:
    """An `AFD_*` variable outside `AFDConfig`: read where it is used (a kernel choice, a library path, the log
    level), by `afd up` or the operator, always through `process_setting`, and not passed on by `config_to_env`."""

    name: str
    default: str  # the text an unset or empty variable stands for
    help: str
    read_by: str
    choices: tuple[str, ...] = ()
    parse: Callable[[str], Any] = str


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be positive seconds")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise ValueError("must be a port, 1..65535")
    return value


def _path(text: str) -> Path:
    return Path(text).expanduser()  # depends on $HOME too: never cached


SMALL_MOE_MAX_TOKENS = 16  # afd.kernels.moe_small.MAX_TOKENS (a test keeps them equal; this module is torch-free)


def _small_tokens(text: str) -> int:
    value = int(text)
    if not 0 <= value <= SMALL_MOE_MAX_TOKENS:
        raise ValueError(f"must be 0 (off) to {SMALL_MOE_MAX_TOKENS} tokens")
    return value


def _level(text: str) -> str:
    name = text.strip().upper()
    if not isinstance(logging.getLevelName(name), int):
        raise ValueError("must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return name


PROCESS_VARIABLES: dict[str, ProcessVariable] = {v.name: v for v in (
    ProcessVariable("AFD_CONFIG_FILE", "", "YAML/JSON settings file (keys: the setting names above), below the "
                    "environment and flags; `--config` of the commands.", "afd serve, up, generate", parse=str),
    ProcessVariable("AFD_TOPOLOGY", "", "Both rank counts at once, e.g. `2A1F` (wins over `AFD_NUM_ATTENTION_RANKS` "
                    "and `AFD_NUM_FFN_RANKS`); `--topology` of the commands.", "afd serve, up, generate"),
    ProcessVariable("AFD_LOG_LEVEL", "", "Python log level (`DEBUG` … `CRITICAL`); unset: `INFO` for `afd serve`, "
                    "`WARNING` for the other commands.", "afd (every command)", parse=_level),
    ProcessVariable("AFD_SWITCH_INTERVAL_S", "", "Experiment: the interpreter's GIL hand-off interval "
                    "(`sys.setswitchinterval`) of `afd serve`; unset: Python's 0.005 s.", "afd serve", parse=_seconds),
    ProcessVariable("AFD_MOE_KERNEL", "auto", "Routed-expert kernel: `triton` (fused, CUDA), `grouped` (torch's "
                    "grouped GEMM) or `auto` (triton where Triton runs).", "afd.kernels.moe",
                    choices=("auto", "triton", "grouped")),
    ProcessVariable("AFD_MOE_SMALL_TOKENS", "8", "Up to this many tokens (at most 16) the `triton` MoE of 16-bit "
                    "experts runs as two GEMV launches (`afd.kernels.moe_small`: no alignment, no separate slot sum; "
                    "the same roundings, K summed in another order); `0`: never. FP8 experts keep the aligned path. "
                    "Default by measurement on an H100 (`bench/kernels/moe_small.py`, session 45): 0.70-0.90x the aligned "
                    "path's time at 1-8 tokens at both sample shapes, the batch-1 step 0.86-0.88x; not measured on "
                    "an H200.", "afd.kernels.moe", parse=_small_tokens),
    ProcessVariable("AFD_FP8_GEMM", "auto", "FP8 block-scaled GEMM: `scaled_mm` (torch, Hopper), `triton` or `auto` "
                    "(scaled_mm on Hopper where the shapes fit).", "afd.kernels.fp8_gemm",
                    choices=("auto", "scaled_mm", "triton")),
    ProcessVariable("AFD_PDL", "false", "Experiment: launch the decode path's Triton kernels with programmatic "
                    "dependent launch (Hopper and later: each starts while the one before drains, waiting for it on "
                    "the device; `afd.kernels.pdl`). Off by measurement: 0.92-0.94x on the attention-only step at "
                    "batch 1, 1.07x slower on the monolith's (bench/step/step_floor.py --pdl off,on, session 44).",
                    "afd.kernels.pdl", parse=parse_bool),
    ProcessVariable("AFD_BATCH_INVARIANT", "false", "`true`: on CUDA a token's result no longer depends on what "
                    "shares its step (`afd.kernels.batch_invariant`: every dense GEMM one fixed-tiling Triton kernel "
                    "instead of cuBLAS's per-row-count choice, one MoE setting for every token count, fixed decode "
                    "key slices). For determinism and parity across topologies (bf16 2A1F = monolith); slower.",
                    "afd.kernels.batch_invariant", parse=parse_bool),
    ProcessVariable("AFD_FUSED_GLUE", "true", "`false`: the torch path instead of the fused RMSNorm/RoPE glue kernels "
                    "on CUDA.", "afd.kernels.norm_rope", parse=parse_bool),
    ProcessVariable("AFD_NCCL_LIBRARY", "", "Path of the libnccl to load first (else the one torch loaded, then "
                    "`nvidia.nccl`'s).", "afd.connector.transports.nccl.lib"),
    ProcessVariable("AFD_CACHE_DIR", "~/.cache/afd", "Where `afd up` keeps the tiny model it makes on first use.",
                    "afd up", parse=_path),
    ProcessVariable("AFD_OPERATOR_RESYNC_SECONDS", "10", "How often the operator reconciles every AFDDeployment "
                    "without an event.", "afd operator", parse=_seconds),
    ProcessVariable("AFD_ROUTE_RANKS", "", "The attention ranks `afd route` spreads requests over, comma-separated: "
                    "DNS names resolved again every `AFD_ROUTE_REFRESH_S` (each address a rank; the operator names a "
                    "headless Service over the Ready attention pods of every group), or fixed `http://host:port` URLs; "
                    "`--ranks`.", "afd route"),
    ProcessVariable("AFD_ROUTE_RANK_HTTP_PORT", "8000", "The ranks' API port (`AFD_HTTP_PORT` of the ranks) for the "
                    "addresses `AFD_ROUTE_RANKS` resolves to.", "afd route", parse=_port),
    ProcessVariable("AFD_ROUTE_RANK_METRICS_PORT", "9090", "The ranks' probe and metrics port (`AFD_METRICS_PORT` of "
                    "the ranks): `afd route` polls `/health` and `/metrics` there for readiness and load.",
                    "afd route", parse=_port),
    ProcessVariable("AFD_ROUTE_REFRESH_S", "2", "How often `afd route` resolves `AFD_ROUTE_RANKS` again (ranks "
                    "that left are dropped, new ones added); ranks' readiness and load are polled every second.",
                    "afd route", parse=_seconds),
)}


_PARSED: dict[tuple[str, str], Any] = {}  # (variable, text) → value: kernels ask on every call


def process_setting(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The typed value of process variable `name` (`PROCESS_VARIABLES`) from `env` (default: this process's
    environment, read now, not at import); a bad value is a `ConfigError` naming the variable."""
    raw = (os.environ if env is None else env).get(name, "")
    if (name, raw) in _PARSED:
        return _PARSED[name, raw]
    variable = PROCESS_VARIABLES[name]
    text = raw or variable.default
    if variable.choices and text not in variable.choices:
        raise ConfigError(f"{name}={text!r}: must be one of {', '.join(variable.choices)}")
    try:
        value = variable.parse(text) if text else text
    except ValueError as err:
        raise ConfigError(f"{name}={text!r}: {err}") from None
    if variable.parse is not _path:
        _PARSED[name, raw] = value
    return value
