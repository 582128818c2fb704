"""No two modules of `runtime/afd` share a name unless they are the same thing for two roles (or two model
families): a reader who meets `buckets.py` twice should not have to open both to learn that they hold different
things. Python's own names (`__init__.py`, `__main__.py`) are left out.

A package that holds one module per member of a set (a module per role, a module per model family) names each
after its member, so such a name comes back in every package of that kind. A repeated name passes when it names a
member of one of `MEMBER_SETS` and every package holding it holds another member of that set too; any other
repeated name is a clash to rename.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"

PYTHON_NAMES = frozenset({"__init__", "__main__"})

# name of the set: (its members, why a package holds a module for each).
MEMBER_SETS: dict[str, tuple[frozenset[str], str]] = {
    "roles": (frozenset({"attention", "ffn", "monolithic"}),
              "a role's wiring, or one end of a transport, in a package with a module per role"),
    "model families": (frozenset({"deepseek_v2", "deepseek_v3", "qwen3_moe"}),
                       "afd's own models and the vLLM plugin's adapters, one module per family, named as vLLM names "
                       "the model"),
}

# Modules that repeat a name until another change moves them, by their paths under afd/, and why they are left:
# the rule above does not judge them. An entry whose paths are not all there any more fails the test too, so what
# replaced them is judged again.
PENDING: dict[tuple[str, ...], str] = {}  # none left


def modules_by_name(root: Path) -> dict[str, list[str]]:
    """Module name → its paths under `root/afd` (relative to it), for every `.py` but Python's own names."""
    found: dict[str, list[str]] = defaultdict(list)
    base = root / "afd"
    for path in sorted(base.rglob("*.py")):
        if path.stem not in PYTHON_NAMES:
            found[path.stem].append(path.relative_to(base).as_posix())
    return dict(found)


def _member_of_a_set(name: str, path: str, names_in: dict[str, set[str]], sets) -> bool:
    """`path` is one module of a package with a module per member of a set `name` belongs to."""
    package = path.rpartition("/")[0]
    return any(name in members and (names_in[package] & members) - {name} for members, _ in sets.values())


def name_clashes(root: Path, sets=MEMBER_SETS, pending=PENDING) -> list[str]:
    """Every module name repeated under `root/afd` that the rule does not let pass, and every stale `pending` entry."""
    by_name = modules_by_name(root)
    names_in: dict[str, set[str]] = defaultdict(set)
    for name, paths in by_name.items():
        for path in paths:
            names_in[path.rpartition("/")[0]].add(name)
    excused = {path for paths in pending for path in paths}
    problems = []
    for name, paths in sorted(by_name.items()):
        if len(paths) > 1 and not all(_member_of_a_set(name, path, names_in, sets)
                                      for path in paths if path not in excused):
            problems.append(f"{name}.py names different things: {', '.join(paths)}; rename so each name says what "
                            f"it holds")
    present = {path for paths in by_name.values() for path in paths}
    problems += [f"pending {', '.join(paths)} is gone: remove it from PENDING" for paths in pending
                 if not set(paths) <= present]
    return problems


def test_no_two_modules_share_a_name_unless_each_is_one_role_or_family_of_a_set():
    problems = name_clashes(RUNTIME)
    assert not problems, "\n".join(problems)


def _write(root: Path, names: list[str]) -> Path:
    for name in names:
        path = root / "afd" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    return root


def test_a_clash_is_named_and_a_module_per_role_passes(tmp_path):
    root = _write(tmp_path, ["__init__.py", "__main__.py", "server/__init__.py", "server/__main__.py",
                             "graphs/buckets.py", "metrics/buckets.py",
                             "roles/attention.py", "roles/ffn.py", "nccl/attention.py", "nccl/ffn.py",
                             "models/attention.py", "models/layers.py", "old/ffn.py", "older/ffn.py"])
    pending = {("old/ffn.py", "older/ffn.py"): "moving", ("gone.py", "graphs/buckets.py"): "moved"}
    assert name_clashes(root, MEMBER_SETS, pending) == [
        "attention.py names different things: models/attention.py, nccl/attention.py, roles/attention.py; "
        "rename so each name says what it holds",
        "buckets.py names different things: graphs/buckets.py, metrics/buckets.py; rename so each name says what "
        "it holds",
        "pending gone.py, graphs/buckets.py is gone: remove it from PENDING"]
