#!/usr/bin/env python3
"""Print the import arrows between the runtime's packages, the ones pointing up the layer order, and the cycles.

Built on the layering test's own reading of the imports (`tests/runtime/test_layering.py`: `ast`, every import
at any depth, the layer order `LAYERS`), so what this prints is what the test checks. A unit is a top-level
module or package of `afd` (`afd/engine/` → `engine`); an arrow `a → b (n)` means n modules of `a` import
modules of `b`.

Usage:
  python scripts/import_graph.py                      # this checkout's runtime/
  python scripts/import_graph.py --root DIR           # DIR holds afd/ (or is afd/ itself), e.g. an older worktree
  python scripts/import_graph.py --summary            # the counts, the arrows pointing up and the cycles only
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from test_layering import LAYERS, RUNTIME, cycles, import_graph, local_imports, unit_of  # noqa: E402


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
             f"cycles between modules: {len(module_cycles)}", *(f"  {' ⇄ '.join(group)}" for group in module_cycles)]
    if not summary:
        lines.append("package arrows (importer → imported (modules of the importer that import it)):")
        for unit in sorted(units, key=lambda u: (depth.get(u, -1), u)):
            targets = sorted((t for s, t in arrows if s == unit), key=lambda t: (depth.get(t, -1), t))
            if targets:
                lines.append(f"  {unit} → " + ", ".join(f"{t} ({arrows[unit, t]})" for t in targets))
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
