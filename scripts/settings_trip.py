#!/usr/bin/env python3
"""How a rank's settings travel through the code, measured on a running attention rank.

Runs `afd up --topology 1A1F` on the tiny model of a checkpoint-less machine (the demo request included) with a
profile hook in every rank process; the attention rank records each call into an `afd` function that receives a
settings object (the `AFDConfig` or one of its sections: an instance of a class defined under `afd.config`,
`Topology` left out) as an argument, with the module that called it. It prints:

- how many `afd` modules receive settings, and the hand-overs: distinct (calling module → called module) pairs;
- hand-overs up the layers (tests/runtime/test_layering.py `LAYERS`): a lower module passing settings to a higher one
  (a callback up);
- modules handed settings by more than one module: where the trip enters a module twice.

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
                caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
                with _lock:
                    _file.write(f"{caller} {module} {code.co_qualname}\\n")
                return

    sys.setprofile(_hook)
    threading.setprofile(_hook)
'''


def record(root: Path, python: str, timeout_s: float) -> list[tuple[str, str, str]]:
    """(calling module, called module, function) of every settings-receiving call the attention rank of `afd up`
    made, in order."""
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
        return [tuple(line.split(" ", 2)) for line in out.read_text().splitlines() if line.count(" ") >= 2]


def analyse(calls: list[tuple[str, str, str]], root: Path) -> dict:
    """The hand-overs of settings between modules in `calls`, judged by `root`'s own layer order."""
    sys.path.insert(0, str(root / "tests" / "runtime"))
    from test_layering import LAYERS, unit_of  # the measured tree's own order

    depth = {unit: level for level, (_, units) in enumerate(LAYERS) for unit in units}
    modules = sorted({callee for _, callee, _ in calls})
    edges = sorted({(caller, callee) for caller, callee, _ in calls if caller != callee})
    up = [(a, b) for a, b in edges if a.startswith("afd.") and depth[unit_of(b)] < depth[unit_of(a)]]
    callers: dict[str, set[str]] = {}
    for caller, callee in edges:
        callers.setdefault(callee, set()).add(caller)
    again = {module: sorted(found) for module, found in callers.items() if len(found) > 1}
    return {"modules": modules, "edges": edges, "up": up, "again": again}


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
    print(f"{root}: the attention rank's settings reach {len(found['modules'])} modules in {len(calls)} calls, over "
          f"{len(found['edges'])} hand-overs between modules; {len(found['up'])} hand-overs up the layers; "
          f"{len(found['again'])} modules handed settings by more than one module")
    if args.list:
        for caller, callee in found["edges"]:
            mark = "  (up)" if (caller, callee) in found["up"] else ""
            print(f"  {caller or '<entry>'} → {callee}{mark}")
        for module, callers in found["again"].items():
            print(f"  {module} is handed settings by {', '.join(callers)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
