#!/usr/bin/env python3
"""Print the import arrows between the runtime's packages, the ones pointing up the layer order, the cycles, and
the modules that import the whole config (`AFDConfig`; issue 50: entry points and role builders only).

Built on the layering test's own reading of the imports (`tests/runtime/test_layering.py`: `ast`, every import
at any depth, the layer order `LAYERS`), so what this prints is what the test checks. A unit is a top-level
module or package of `afd` (`afd/engine/` → `engine`); an arrow `a → b (n)` means n modules of `a` import
modules of `b`.

Usage:
  python scripts/import_graph.py                      # this checkout's runtime/
  python scripts/import_graph.py --root DIR           # DIR holds afd/ (or is afd/ itself), e.g. an older worktree
  python scripts/import_graph.py --summary            # all but the per-package arrow list
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from test_layering import (  # noqa: E402
    LAYERS, RUNTIME, WHOLE_CONFIG_LIMITS, config_loaders, cycles, import_graph, local_imports, unit_of,
    whole_config_importers,
)


def runtime_root(path: Path) -> Path:
    """The folder that holds `afd/`, given it or `afd/` itself."""
    path = path.resolve()
    if (path / "afd" / "__init__.py").is_file():
        return path
    if path.name == "afd" and (path / "__init__.py").is_file():
        return path.parent
    raise SystemExit(f"--root {path}: expected a folder holding afd/__init__.py (or the afd/ folder itself)")


def report(root: Path, summary: bool = False) -> list[str]:
    """The lines printed for the runtime under `root`."""
    graph = import_graph(root)
    depth = {unit: level for level, (_, units) in enumerate(LAYERS) for unit in units}
    units = sorted({unit_of(module) for module in graph})
    arrows: Counter[tuple[str, str]] = Counter()
    up = []
    for source, targets in sorted(graph.items()):
        for unit in sorted({unit_of(target) for target in targets} - {unit_of(source)}):
            arrows[unit_of(source), unit] += 1
        for target, line in sorted(targets.items()):
            low, high = unit_of(source), unit_of(target)
            if low != high and low in depth and high in depth and depth[high] < depth[low]:
                up.append(f"  {source}:{line} → {target}  ({LAYERS[depth[low]][0]} → {LAYERS[depth[high]][0]})")
    edges: dict[str, set[str]] = {}
    for source, target in arrows:
        edges.setdefault(source, set()).add(target)
    unit_cycles, module_cycles = cycles(edges), cycles({m: set(t) for m, t in graph.items()})
    local = local_imports(root)
    lines = [f"{root / 'afd'}: {len(graph)} modules in {len(units)} units, {len(arrows)} package arrows, "
             f"{sum(map(len, graph.values()))} module imports of afd",
             f"imports inside functions: {len(local)}, {sum(given for _, given in local)} with a "
             f"'# local import: <reason>'",
             f"units in no layer of LAYERS: {', '.join(u for u in units if u not in depth) or 'none'}",
             f"module imports pointing up the layer order: {len(up)}", *up,
             f"cycles between units: {len(unit_cycles)}", *(f"  {' ⇄ '.join(group)}" for group in unit_cycles),
             f"cycles between modules: {len(module_cycles)}", *(f"  {' ⇄ '.join(group)}" for group in module_cycles),
             *whole_config_lines(root)]
    if not summary:
        lines.append("package arrows (importer → imported (modules of the importer that import it)):")
        for unit in sorted(units, key=lambda u: (depth.get(u, -1), u)):
            targets = sorted((t for s, t in arrows if s == unit), key=lambda t: (depth.get(t, -1), t))
            if targets:
                lines.append(f"  {unit} → " + ", ".join(f"{t} ({arrows[unit, t]})" for t in targets))
    return lines


def whole_config_lines(root: Path) -> list[str]:
    """How many modules name the whole `AFDConfig` (issue 50: entry points and role builders only), which ones, and
    the entry points that load it only to hand its sections on; the operator's too, beside a checkout's runtime."""
    lines = []
    operator = root.parent / "operator" / "afd_operator"
    for package in [root / "afd"] + ([operator] if operator.is_dir() else []):
        importers = whole_config_importers(package)
        lines += [f"{package.name} modules importing the whole config (AFDConfig) outside config/: {len(importers)} "
                  f"(at most {WHOLE_CONFIG_LIMITS.get(package.name, 0)})", *(f"  {name}" for name in importers)]
        loaders = config_loaders(package)
        lines += [f"{package.name} entry points loading it (load_config) to hand on its sections: {len(loaders)}",
                  *(f"  {name}" for name in loaders)]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=RUNTIME, help="the folder holding afd/ (default: %(default)s)")
    parser.add_argument("--summary", action="store_true", help="no per-package arrow list")
    args = parser.parse_args(argv)
    print("\n".join(report(runtime_root(args.root), args.summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
