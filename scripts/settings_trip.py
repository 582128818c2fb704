#!/usr/bin/env python3
"""How a rank's settings travel through the code, measured on a running attention rank.

Runs `afd up --topology 1A1F` on the tiny model of a checkpoint-less machine (the demo request included) with a
profile hook in every rank process; the attention rank records each call into an `afd` function that receives a
settings object (the `AFDConfig` or one of its sections: an instance of a class defined under `afd.config`,
`Topology` left out) as an argument. From that call sequence it prints:

- modules entered: how many `afd` modules receive settings;
- trips back up: consecutive calls whose callee's layer (tests/runtime/test_layering.py `LAYERS`) is above the
  caller's, i.e. the settings climbing back up the layer order;
- returns: calls into a module the settings had already left for another module.

Usage (from the repo root; `--root` measures another checkout, e.g. an older worktree, with its own LAYERS):
  .venv/bin/python scripts/settings_trip.py [--root DIR] [--list]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOOK = '''
import os, sys, threading
_OUT = os.environ.get("AFD_TRIP_OUT")
if _OUT and os.environ.get("AFD_ROLE") == "attention":
    _lock = threading.Lock()
    _file = open(_OUT, "a", buffering=1)

    def _is_settings(value):
        kind = type(value)
        return kind.__module__.startswith("afd.config") and kind.__name__ != "Topology"

    def _hook(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("afd.") or module.startswith("afd.config"):
            return
        code = frame.f_code
        count = code.co_argcount + code.co_kwonlyargcount
        values = frame.f_locals
        for name in code.co_varnames[:count]:
            if _is_settings(values.get(name)):
                with _lock:
                    _file.write(f"{module} {code.co_qualname}\\n")
                return

    sys.setprofile(_hook)
    threading.setprofile(_hook)
'''


def record(root: Path, python: str, timeout_s: float) -> list[tuple[str, str]]:
    """(module, function) of every settings-receiving call the attention rank of `afd up` made, in order."""
    with tempfile.TemporaryDirectory(prefix="afd-trip-") as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(HOOK)
        out = Path(tmp) / "calls.txt"
        env = {**os.environ, "AFD_TRIP_OUT": str(out),
               "PYTHONPATH": os.pathsep.join([tmp, str(root / "runtime"), str(root / "operator")])}
        up = subprocess.Popen([python, "-m", "afd", "up", "--topology", "1A1F", "--port", "18431"], cwd=root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        try:
            for line in up.stdout:
                if line.startswith("afd up: ready: "):
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"afd up did not become ready within {timeout_s:.0f} s")
        finally:
            os.killpg(up.pid, signal.SIGTERM)
            up.wait(60)
        return [tuple(line.split(" ", 1)) for line in out.read_text().splitlines() if " " in line]


def analyse(calls: list[tuple[str, str]], root: Path) -> dict:
    """The three counts of the module docstring, over `calls` with `root`'s own layer order."""
    sys.path.insert(0, str(root / "tests" / "runtime"))
    from test_layering import LAYERS, unit_of  # the measured tree's own order

    depth = {unit: level for level, (_, units) in enumerate(LAYERS) for unit in units}
    modules = [module for module, _ in calls]
    path = [m for i, m in enumerate(modules) if i == 0 or m != modules[i - 1]]  # a stay in one module is one visit
    ups = [(a, b) for a, b in zip(path, path[1:]) if depth.get(unit_of(b), 99) < depth.get(unit_of(a), 99)]
    seen, returns = set(), []
    for module in path:
        if module in seen:
            returns.append(module)
        seen.add(module)
    return {"modules": sorted(seen), "path": path, "ups": ups, "returns": returns}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for afd up to answer its demo request")
    parser.add_argument("--list", action="store_true", help="print the path of modules and every trip back up")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    calls = record(root, args.python, args.timeout)
    if not calls:
        raise SystemExit("no settings-receiving call was recorded (did the attention rank start?)")
    found = analyse(calls, root)
    print(f"{root}: the attention rank's settings entered {len(found['modules'])} modules in {len(calls)} calls; "
          f"{len(found['ups'])} trips back up the layers; {len(found['returns'])} returns to a module already left")
    if args.list:
        print("path:", " → ".join(found["path"]))
        for a, b in found["ups"]:
            print(f"  up: {a} → {b}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
