"""The operator's layers point one way: every import inside `operator/afd_operator` (module-level and
function-local, read with `ast`) goes to the same layer or one below, no two units or modules import each
other, and only the kopf handlers and the reconcile package reach the API-server adapter.

A unit is a top-level module (`afd_operator/cli.py` → `cli`) or sub-package (`afd_operator/ratio/` → `ratio`).
The layer order is written once, here (`LAYERS`); docs/architecture.md describes the same packages.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator"
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from test_layering import cycles, import_graph, unit_of  # noqa: E402  the runtime check's reading of imports

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


def layer_problems(root: Path, layers=LAYERS) -> list[str]:
    """Every unit in no layer, import pointing up, adapter import from elsewhere, and unit or module cycle."""
    depth = {unit: level for level, (_, units) in enumerate(layers) for unit in units}
    graph = import_graph(root, "afd_operator")
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
    for kind, edges in (("units", units), ("modules", {module: set(targets) for module, targets in graph.items()})):
        problems += [f"{kind} import each other: {' ⇄ '.join(group)}" for group in cycles(edges)]
    return problems


def test_operator_imports_point_down_and_never_in_a_circle():
    problems = layer_problems(OPERATOR)
    assert not problems, "\n".join(problems)


def test_every_unit_of_the_operator_is_in_a_layer_and_every_layer_has_code():
    found = {unit_of(module) for module in import_graph(OPERATOR, "afd_operator")}
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
