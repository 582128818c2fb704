#!/usr/bin/env python3
"""Print the import arrows between the runtime's packages, the ones pointing up the layer order, and the cycles;
then the same for the benchmarks (`bench/`, by their own order), with the private `afd` names they use.

Built on the layering test's own reading of the imports (`tests/runtime/test_layering.py`: `ast`, every import
at any depth, the layer order `LAYERS`), so what this prints is what the test checks. A unit is a top-level
module or package of `afd` (`afd/engine/` → `engine`); an arrow `a → b (n)` means n modules of `a` import
modules of `b`.

Usage:
  python scripts/import_graph.py                      # this checkout's runtime/
  python scripts/import_graph.py --root DIR           # DIR holds afd/ (or is afd/ itself), e.g. an older worktree
  python scripts/import_graph.py --summary            # the counts, the arrows pointing up and the cycles only

bench/ is read beside the runtime's folder (`--root`'s parent) where there is one.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from test_layering import (BENCH_LAYERS, LAYERS, RUNTIME, bench_problems, cycles, import_graph,  # noqa: E402
                           imports_of, local_imports, module_name, unit_of)


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


def bench_report(root: Path, runtime: Path, summary: bool = False) -> list[str]:
    """The lines printed for `root/bench`: its modules, imports of each other and of `afd`, and what breaks its order."""
    graph = import_graph(root, "bench")
    afd_modules = {module_name(path, runtime) for path in (runtime / "afd").rglob("*.py")}
    afd_imports = sum(len({name for name, _ in imports_of(path, module_name(path, root))} & afd_modules)
                      for path in sorted((root / "bench").rglob("*.py")))
    depth = {unit: level for level, (_, units) in enumerate(BENCH_LAYERS) for unit in units}
    problems = bench_problems(root, runtime)

    def named(word: str) -> list[str]:
        return [problem for problem in problems if word in problem]
    up, private = named("above it"), named("private afd name")
    lines = [f"{root / 'bench'}: {len(graph)} modules in {len({unit_of(m) for m in graph} - {'__init__'})} folders, "
             f"{sum(map(len, graph.values()))} module imports of bench, {afd_imports} of afd",
             f"bench imports pointing up its order ({' > '.join(layer for layer, _ in BENCH_LAYERS)}): {len(up)}",
             *(f"  {problem}" for problem in up),
             f"cycles between bench modules: {len(named('import each other'))}",
             *(f"  {problem}" for problem in named("import each other")),
             f"afd modules importing bench: {len(named('never imports a benchmark'))}",
             *(f"  {problem}" for problem in named("never imports a benchmark")),
             f"private afd names used by bench: {len(private)}", *(f"  {problem}" for problem in private),
             *(f"  {problem}" for problem in named("in no layer"))]
    if not summary:
        arrows: dict[tuple[str, str], int] = {}
        for source, targets in graph.items():
            for unit in {unit_of(target) for target in targets} - {unit_of(source)}:
                arrows[unit_of(source), unit] = arrows.get((unit_of(source), unit), 0) + 1
        lines.append("bench folder arrows (importer → imported (modules of the importer that import it)):")
        for unit in sorted({s for s, _ in arrows}, key=lambda u: (depth.get(u, -1), u)):
            lines.append(f"  {unit} → " + ", ".join(f"{t} ({arrows[unit, t]})" for s, t in sorted(arrows) if s == unit))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=RUNTIME, help="the folder holding afd/ (default: %(default)s)")
    parser.add_argument("--summary", action="store_true", help="no per-package arrow list")
    args = parser.parse_args(argv)
    root = runtime_root(args.root)
    lines = report(root, args.summary)
    if (root.parent / "bench").is_dir():
        lines += bench_report(root.parent, root, args.summary)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
