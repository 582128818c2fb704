#!/usr/bin/env python3
"""Keep the Helm chart's copies of the canonical files equal to their sources.

The chart must be installable on its own (`helm install` sees only `charts/afd-operator/`),
so it carries copies of two files that live elsewhere in the repository:

  crds/*.yaml                       -> charts/afd-operator/crds/      (Helm installs these)
  operator/afd_operator/rbac.yaml   -> charts/afd-operator/files/rbac.yaml   (ClusterRole rules)

Run it after changing either source:

  python scripts/sync_chart.py          # copy the sources into the chart
  python scripts/sync_chart.py --check  # exit 1 and name the stale files (tests/charts runs this)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "afd-operator"


def copies() -> dict[Path, Path]:
    """Chart copy → canonical source, for every file the chart mirrors."""
    pairs = {CHART / "crds" / src.name: src for src in sorted((ROOT / "crds").glob("*.yaml"))}
    pairs[CHART / "files" / "rbac.yaml"] = ROOT / "operator" / "afd_operator" / "rbac.yaml"
    return pairs


def stale() -> list[str]:
    """Human-readable problems: copies that differ from, or lack, a source; extra CRD files."""
    problems = []
    pairs = copies()
    for copy, src in pairs.items():
        if not copy.exists():
            problems.append(f"{copy.relative_to(ROOT)} is missing (source {src.relative_to(ROOT)})")
        elif copy.read_bytes() != src.read_bytes():
            problems.append(f"{copy.relative_to(ROOT)} differs from {src.relative_to(ROOT)}")
    for extra in sorted((CHART / "crds").glob("*")):
        if extra not in pairs:
            problems.append(f"{extra.relative_to(ROOT)} has no source in crds/")
    return problems


def sync() -> list[str]:
    """Write every copy from its source and delete chart CRDs whose source is gone; returns what changed."""
    changed = []
    pairs = copies()
    for copy, src in pairs.items():
        if not copy.exists() or copy.read_bytes() != src.read_bytes():
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_bytes(src.read_bytes())
            changed.append(f"wrote {copy.relative_to(ROOT)}")
    for extra in sorted((CHART / "crds").glob("*")):
        if extra not in pairs:
            extra.unlink()
            changed.append(f"removed {extra.relative_to(ROOT)}")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale copies (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for problem in problems:
            print(f"stale: {problem}", file=sys.stderr)
        if problems:
            print("fix: python scripts/sync_chart.py", file=sys.stderr)
        return 1 if problems else 0
    for line in sync():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
