"""Triton kernels compiled while a rank serves: each one pauses the step that met it (a compile, or a load from
Triton's disk cache, takes ~0.1–1 s), which shows up as a time-to-first-token or inter-token-latency spike.

Warm-up (the MoE kernels at every tuned size, the profile step, graph capture) is meant to compile every
specialization serving will use: a kernel is compiled anew for each new set of constexpr settings and for each
integer argument that is 1, a multiple of 16 or neither, and each pointer's 16-byte alignment. This module
installs Triton's cache-miss hook (`triton.knobs.runtime.jit_cache_hook`, called once per new specialization in a
process) and tells the two phases apart: compiles during warm-up are counted and logged once at INFO; a compile
while serving is logged at WARNING with the kernel and its arguments' specialization, and handed to listeners
(`afd_kernel_compiles_total`). The role code says when it serves (`WATCH.set_serving`): the attention and monolithic
ranks once their engine starts, the FFN rank per step (steps its peers mark warm-up or capture are warm-up).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class CompileWatch:
    """Counts Triton specializations compiled in this process, apart by phase; `install` hooks Triton."""

    def __init__(self):
        self.serving = False  # compiles now are the serving kind (`set_serving`)
        self._served = False
        self.warmup_compiles = 0
        self._warmed: dict[str, list[str]] = {}  # kernel name → its warm-up specializations, to compare with
        self.serving_compiles: list[str] = []  # each one's description, in order
        self._listeners: list[Callable[[str], None]] = []
        self._installed = False
        self._lock = threading.Lock()

    def install(self) -> bool:
        """Hook Triton (keeping a hook someone set before); False where Triton does not import or has no hook."""
        if self._installed:
            return True
        try:
            from triton import knobs  # local import: Triton is optional (CPU images may lack it)
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return False
        previous = runtime.jit_cache_hook

        def hook(*args, **kwargs):
            self.compiled(describe(kwargs))
            return previous(*args, **kwargs) if previous is not None else None

        runtime.jit_cache_hook = hook
        self._installed = True
        return True

    def on_serving_compile(self, listener: Callable[[str], None]) -> None:
        """Call `listener(description)` for each compile while serving (a metric's increment)."""
        self._listeners.append(listener)

    def set_serving(self, serving: bool = True) -> None:
        """Whether compiles from now on are the serving kind: the attention and monolithic ranks say so once their
        engine starts, the FFN rank before each step. The first time, what warm-up compiled is logged."""
        if serving and not self._served:
            self._served = True
            log.info("warm-up compiled %d Triton kernel specializations", self.warmup_compiles)
        self.serving = serving

    def warm_up_specializations(self, kernel: str) -> list[str]:
        """What warm-up compiled of `kernel` (its name), to set beside a serving compile."""
        return list(self._warmed.get(kernel, []))

    def compiled(self, description: str) -> None:
        """One new specialization (Triton's hook calls this before compiling or loading it)."""
        kernel = kernel_name(description)
        with self._lock:
            if not self.serving:
                self.warmup_compiles += 1
                self._warmed.setdefault(kernel, []).append(description)
                return
            self.serving_compiles.append(description)
            warmed = self.warm_up_specializations(kernel)
        log.warning("compiled Triton kernel %s while serving: the step that met it paused for the compile (warm-up "
                    "did not reach this specialization; it compiled %s)", description,
                    "; ".join(warmed) if warmed else "no specialization of this kernel")
        for listener in self._listeners:
            listener(description)


def kernel_name(description: str) -> str:
    """The kernel's name at the head of a `describe` text (or of Triton's repr)."""
    return description.split("(", 1)[0].split("[", 1)[0]


def describe(hook_kwargs: dict) -> str:
    """The kernel and its specialization as Triton's hook gives them: the name, then each argument's type with
    `%16` where Triton assumed 16-byte alignment / divisibility, and the constexprs (from `compile`, which Triton
    3.6 and 3.7 both pass); else Triton's own `repr`, else the function's name."""
    fn = hook_kwargs.get("fn")
    name = getattr(fn, "name", None)
    compiled = hook_kwargs.get("compile") or {}
    signature = compiled.get("signature")
    if name and isinstance(signature, dict):
        try:
            return f"{name}({', '.join(_arguments(signature, compiled))})"
        except Exception:  # noqa: BLE001 - a description never stops a compile
            pass
    text = hook_kwargs.get("repr")
    if text:
        return str(text)
    return str(name or fn or "an unnamed kernel")


def _arguments(signature: dict, compiled: dict) -> list[str]:
    configs = compiled.get("configs") or [{}]
    divisible = {key[0] for key, attrs in (configs[0] or {}).items()
                 if any(attr and attr[0] == "tt.divisibility" for attr in attrs)}
    constants = {key[0] if isinstance(key, tuple) else key: value
                 for key, value in (compiled.get("constants") or {}).items()}
    shown = []
    for index, (arg, kind) in enumerate(signature.items()):
        if kind == "constexpr":
            value = constants.get(index, constants.get(arg, "?"))
            shown.append(f"{arg}={value}")
        else:
            shown.append(f"{arg}: {kind}{' %16' if index in divisible else ''}")
    return shown


WATCH = CompileWatch()  # one per process: Triton's hook is process-wide
