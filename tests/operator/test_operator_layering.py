"""The operator's layers point one way: every import inside `operator/afd_operator` (module-level and
function-local, read with `ast`) goes to the same layer or one below, no two units or modules import each
other, and only the kopf handlers and the reconcile package reach the API-server adapter.

A unit is a top-level module (`afd_operator/cli.py` → `cli`) or sub-package (`afd_operator/ratio/` → `ratio`).
The layer order is written once, here (`LAYERS`); docs/architecture.md describes the same packages.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator"

# From the entry points down; a unit imports units of its own layer or of layers below it.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("entry points", frozenset({"__main__", "cli"})),
    ("kopf handlers and the operator's own metrics", frozenset({"handlers", "metrics"})),
    ("reconcile one resource", frozenset({"reconcile"})),
    ("the API-server adapter", frozenset({"apiserver"})),
    ("spec.ratio and spec.autoscaling", frozenset({"ratio", "autoscaler"})),
    ("groups: observe and plan", frozenset({"groups"})),
    ("rendering", frozenset({"rendering"})),
    ("the resource's model", frozenset({"__init__", "model"})),
)
ADAPTER = "apiserver"
ADAPTER_USERS = frozenset({"handlers", "reconcile"})  # the units allowed to import the adapter


def unit_of(module: str) -> str:
    """`afd_operator.ratio.feed` → `ratio`; `afd_operator` itself → `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def import_graph(root: Path) -> dict[str, set[str]]:
    """module → the `afd_operator` modules it imports, at any depth, over every `.py` under `root/afd_operator`
    (`from afd_operator.x import name` counts as importing `afd_operator.x`)."""
    paths = {}
    for path in sorted((root / "afd_operator").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)  # a submodule by name
        graph[module] = {name for name in names if name in paths and name != module}
    return graph


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle as `a → b → … → a` (each imports the next), or [] when there is none."""
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as err:
        return list(reversed(err.args[1]))  # graphlib lists each node before the one that imports it
    return []


def layer_problems(root: Path, layers=LAYERS) -> list[str]:
    """Every unit in no layer, import pointing up, adapter import from elsewhere, and unit or module cycle."""
    depth = {unit: level for level, (_, units) in enumerate(layers) for unit in units}
    graph = import_graph(root)
    problems = [f"{unit} is in no layer: add it to LAYERS" for unit in sorted({unit_of(m) for m in graph} - set(depth))]
    if problems:
        return problems
    units: dict[str, set[str]] = {}
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            up, down = unit_of(source), unit_of(target)
            if down == ADAPTER and up not in ADAPTER_USERS | {ADAPTER}:
                problems.append(f"{source} imports {target}: only {sorted(ADAPTER_USERS)} talk to the API server")
            if up == down:
                continue
            units.setdefault(up, set()).add(down)
            if depth[down] < depth[up]:
                problems.append(f"{source} (layer '{layers[depth[up]][0]}') imports {target} "
                                f"(layer '{layers[depth[down]][0]}', above it)")
    for kind, edges in (("units", units), ("modules", graph)):
        if cycle := _cycle(edges):
            problems.append(f"{kind} import each other: {' → '.join(cycle)}")
    return problems


def test_operator_imports_point_down_and_never_in_a_circle():
    problems = layer_problems(OPERATOR)
    assert not problems, "\n".join(problems)


def test_every_unit_of_the_operator_is_in_a_layer_and_every_layer_has_code():
    found = {unit_of(module) for module in import_graph(OPERATOR)}
    assert found == {unit for _, units in LAYERS for unit in units}


def test_the_check_finds_an_upward_import_an_adapter_import_and_a_cycle(tmp_path):
    package = tmp_path / "afd_operator"
    for name, text in {
        "__init__.py": "",
        "model/__init__.py": "",
        "model/spec.py": "from afd_operator.rendering.pod import x\n",  # up
        "rendering/__init__.py": "",
        "rendering/pod.py": "def f():\n    from afd_operator.apiserver import Store\n",  # not an adapter user
        "groups/__init__.py": "",
        "groups/plan.py": "import afd_operator.groups.observe\n",
        "groups/observe.py": "from afd_operator.groups import plan\n",  # a cycle inside a unit
        "apiserver.py": "",
    }.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    problems = "\n".join(layer_problems(tmp_path))
    assert "afd_operator.model.spec (layer 'the resource's model') imports afd_operator.rendering.pod" in problems
    assert "afd_operator.rendering.pod imports afd_operator.apiserver: only" in problems
    assert "modules import each other" in problems and "afd_operator.groups.plan" in problems
