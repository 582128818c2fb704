"""The runtime's layers point one way: every import of `runtime/afd` (module-level and function-local,
read with `ast`) goes to the same layer or one below, and no two packages or modules import each other.
The benchmarks (`bench/`) too, by their own order (`BENCH_LAYERS`, the harness at the bottom): no `afd` module
imports them, and they use `afd`'s public names only.

The layer order is written once, here (`LAYERS`); docs/architecture.md's table must match it. A unit is a
top-level module (`afd/config.py` → `config`) or package (`afd/engine/` → `engine`) of `afd`. An import inside a
function is there only to keep a heavy or optional dependency out, and says so: `# local import: <reason>`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "runtime"

# From the entry points down. A unit imports units of its own layer or of layers below it; within a
# layer the cycle check keeps the imports one way.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("entry points", frozenset({"__main__", "cli"})),
    ("processes and tools", frozenset({"local", "planner", "vllm_plugin"})),
    ("role wiring", frozenset({"roles"})),
    ("HTTP serving", frozenset({"server"})),
    ("runners", frozenset({"runners"})),
    ("engine", frozenset({"engine"})),
    ("step graphs", frozenset({"graphs"})),
    ("links, metrics, KV cache, checkpoint tools",
     frozenset({"connector", "metrics", "kv", "checkpoint_tools"})),
    ("models", frozenset({"models"})),
    ("kernels", frozenset({"kernels"})),
    ("foundation", frozenset({"__init__", "config", "step"})),
)

# Imports still pointing up, each with why it is left and what removes it. A listed import that is gone
# fails the test too, so this list only shrinks.
EXCEPTIONS: dict[tuple[str, str], str] = {}  # none left


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """`afd.engine.engine` → `engine`; `afd` itself → `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path, module: str, top: str = "afd") -> list[tuple[str, int]]:
    """(imported `top` module, line) for every import in `path`, at any depth (functions, `TYPE_CHECKING`)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]  # `from afd.x import submodule`
        else:
            continue
        found += [(name, node.lineno) for name in names if name == top or name.startswith(top + ".")]
    return found


def import_graph(root: Path, package: str = "afd") -> dict[str, dict[str, int]]:
    """module → {`package` module it imports: line} over every `.py` under `root/<package>` (names that are not
    modules, like `from afd.x import function`, resolve to `afd.x`)."""
    paths = {module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        graph[module] = {}
        for name, line in imports_of(path, module, package):
            if name in paths and name != module:
                graph[module].setdefault(name, line)
    return graph


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(edges.get(target, ())))))
            elif target in on_stack:
                low[node] = min(low[node], index[target])
    return found


def layer_problems(root: Path, layers=LAYERS, exceptions=EXCEPTIONS) -> list[str]:
    """Every unit missing from `layers`, import pointing up, package or module cycle, and stale exception."""
    depth = {unit: level for level, (_, units) in enumerate(layers) for unit in units}
    graph = import_graph(root)
    problems = [f"{unit} is in no layer: add it to LAYERS" for unit in sorted({unit_of(m) for m in graph} - set(depth))]
    if problems:
        return problems
    kept: dict[str, set[str]] = {}
    packages: dict[str, set[str]] = {}
    for source, targets in graph.items():
        kept[source] = set()
        for target, line in targets.items():
            if (source, target) in exceptions:
                continue
            kept[source].add(target)
            up, down = unit_of(source), unit_of(target)
            if up == down:
                continue
            packages.setdefault(up, set()).add(down)
            if depth[down] < depth[up]:
                problems.append(f"{source} (line {line}, layer '{layers[depth[up]][0]}') imports {target} "
                                f"(layer '{layers[depth[down]][0]}', above it)")
    problems += [f"units import each other: {' ⇄ '.join(group)}" for group in cycles(packages)]
    problems += [f"modules import each other: {' ⇄ '.join(group)}" for group in cycles(kept)]
    problems += [f"exception {source} → {target} is gone: remove it from EXCEPTIONS"
                 for source, target in exceptions if target not in graph.get(source, {})]
    return problems


def test_runtime_imports_point_down_and_never_in_a_circle():
    problems = layer_problems(RUNTIME)
    assert not problems, "\n".join(problems)


LOCAL_REASON = re.compile(r"# local import: \S")


def _statement_lists(node: ast.AST):
    """The statement lists directly under `node` (bodies, else and finally branches, handlers, match cases)."""
    for name in ("body", "orelse", "finalbody"):
        value = getattr(node, name, None)
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            yield value
    for clause in getattr(node, "handlers", []) + getattr(node, "cases", []):
        yield clause.body


def local_imports(root: Path) -> list[tuple[str, bool]]:
    """(`path:line: statement`, whether it gives its reason) of every import inside a function under `root/afd`.
    The reason is `# local import: <why>` on one of the import's lines, or on the comment line just above it
    (which covers the imports that follow it one after another)."""
    found = []
    for path in sorted((root / "afd").rglob("*.py")):
        lines = path.read_text().splitlines()

        def given(node: ast.stmt) -> bool:
            return any(LOCAL_REASON.search(line) for line in lines[node.lineno - 1: node.end_lineno])

        def visit(node: ast.AST, inside: bool) -> None:
            for statements in _statement_lists(node):
                covered = False  # by a comment above the run of imports this one belongs to
                for statement in statements:
                    if not isinstance(statement, (ast.Import, ast.ImportFrom)):
                        covered = False
                    elif inside:
                        above = lines[statement.lineno - 2].strip() if statement.lineno > 1 else ""
                        covered = covered or (above.startswith("#") and bool(LOCAL_REASON.search(above)))
                        found.append((f"{path.relative_to(root)}:{statement.lineno}: "
                                      f"{lines[statement.lineno - 1].strip()}", covered or given(statement)))
                    is_function = isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef))
                    visit(statement, inside or is_function)

        visit(ast.parse("\n".join(lines), str(path)), False)
    return found


def silent_local_imports(root: Path) -> list[str]:
    """`path:line: statement` of every import inside a function under `root/afd` that gives no reason."""
    return [where for where, given in local_imports(root) if not given]


def test_every_function_local_import_says_why():
    silent = silent_local_imports(RUNTIME)
    assert not silent, ("import these at the top of the module, or say why they must wait with "
                        "`# local import: <reason>` (a heavy or optional dependency):\n" + "\n".join(silent))


def test_a_local_import_without_its_reason_is_named(tmp_path):
    root = _write(tmp_path, {"a.py": "import os\n\n\ndef f():\n"
                                     "    # local import: heavy\n    import json\n    import csv\n\n    import re\n"
                                     "    x = 1\n    import abc\n    import io  # local import: optional\n"
                                     "    # why it is slow\n    import ast\n",
                             "b.py": "class C:\n    def m(self):\n        try:\n            import zlib\n"
                                     "        except ImportError:\n            pass\n"})
    assert silent_local_imports(root) == ["afd/a.py:11: import abc",
                                          "afd/a.py:14: import ast", "afd/b.py:4: import zlib"]


def documented_layers(text: str) -> list[tuple[str, frozenset[str]]]:
    """The rows of the table under "## The layers" (after its header): (layer, units named in backquotes,
    without `.py` or `/`)."""
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| ") and "`" in line][1:]
    return [(layer.strip(), frozenset(name.removesuffix(".py").removesuffix("/") for name in units.split("`")[1::2]))
            for layer, units in rows]


def test_the_architecture_page_draws_the_same_layers():
    assert documented_layers((ROOT / "docs" / "architecture.md").read_text()) == list(LAYERS)


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "afd" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


_TOY_LAYERS = (("top", frozenset({"server"})), ("middle", frozenset({"engine"})),
               ("bottom", frozenset({"__init__", "layout"})))


def test_an_import_pointing_up_is_named_even_inside_a_function(tmp_path):
    root = _write(tmp_path, {"__init__.py": "", "layout.py": "", "server/__init__.py": "",
                             "server/run.py": "from afd.engine.engine import Engine\n",
                             "engine/__init__.py": "",
                             "engine/engine.py": "import afd.layout\n\ndef f():\n    from afd.server import run\n"})
    problems = layer_problems(root, _TOY_LAYERS, {})
    assert problems == ["afd.engine.engine (line 4, layer 'middle') imports afd.server (layer 'top', above it)",
                        "afd.engine.engine (line 4, layer 'middle') imports afd.server.run (layer 'top', above it)",
                        "units import each other: engine ⇄ server",
                        "modules import each other: afd.engine.engine ⇄ afd.server.run"]


def test_a_circle_inside_one_package_and_relative_imports_are_seen(tmp_path):
    root = _write(tmp_path, {"__init__.py": "", "layout.py": "", "engine/__init__.py": "",
                             "engine/a.py": "from . import b\n", "engine/b.py": "def f():\n    from .a import x\n"})
    assert layer_problems(root, _TOY_LAYERS, {}) == ["modules import each other: afd.engine.a ⇄ afd.engine.b"]


def test_an_unplaced_unit_and_a_stale_exception_are_named(tmp_path):
    root = _write(tmp_path, {"__init__.py": "", "layout.py": "", "planner/__init__.py": ""})
    assert layer_problems(root, _TOY_LAYERS, {}) == ["planner is in no layer: add it to LAYERS"]
    root = _write(tmp_path / "stale", {"__init__.py": "", "layout.py": ""})
    assert layer_problems(root, _TOY_LAYERS, {("afd.layout", "afd.server"): "why"}) == [
        "exception afd.layout → afd.server is gone: remove it from EXCEPTIONS"]


# ---------------------------------------------------------------------------------------------- the benchmarks
BENCH_ROOT = ROOT  # holds bench/
# bench/'s folders from the top: a folder imports folders of its own row or below, and `afd`'s public names.
BENCH_LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("comparisons with other systems", frozenset({"comparisons"})),
    ("ranks together", frozenset({"cluster"})),
    ("serving", frozenset({"serving"})),
    ("one step", frozenset({"step"})),
    ("kernels", frozenset({"kernels"})),
    ("harness", frozenset({"harness", "__init__"})),
)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_afd_names(path: Path) -> list[str]:
    """`path:line: name` of every private `afd` name `path` uses: an `afd` module or name with a leading underscore
    imported, or an attribute with one read off a module or name imported from `afd` (`moe_triton._kernel`)."""
    tree = ast.parse(path.read_text(), str(path))
    bound: set[str] = set()  # local names of afd modules and of names imported from afd
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "afd":
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if any(map(_private, node.module.split("."))) or _private(alias.name):
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "afd":
                    bound.add(alias.asname or "afd")
                    if any(map(_private, alias.name.split("."))):
                        found.append((node.lineno, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append((node.lineno, ast.unparse(node)))
    return [f"{path}:{line}: {name}" for line, name in sorted(set(found))]


def bench_problems(root: Path = BENCH_ROOT, runtime: Path = RUNTIME, layers=BENCH_LAYERS) -> list[str]:
    """Every bench folder missing from `layers`, bench import pointing up, module cycle, `afd` module importing
    bench, and private `afd` name a bench uses."""
    depth = {unit: level for level, (_, units) in enumerate(layers) for unit in units}
    graph = import_graph(root, "bench")
    problems = [f"bench/{unit} is in no layer: add it to BENCH_LAYERS"
                for unit in sorted({unit_of(m) for m in graph} - set(depth))]
    if problems:
        return problems
    for source, targets in graph.items():
        for target, line in targets.items():
            up, down = unit_of(source), unit_of(target)
            if depth[down] < depth[up]:
                problems.append(f"{source} (line {line}, '{layers[depth[up]][0]}') imports {target} "
                                f"('{layers[depth[down]][0]}', above it)")
    problems += [f"modules import each other: {' ⇄ '.join(group)}"
                 for group in cycles({m: set(t) for m, t in graph.items()})]
    for path in sorted((runtime / "afd").rglob("*.py")):
        problems += [f"{module_name(path, runtime)} (line {line}) imports {name}: afd never imports a benchmark"
                     for name, line in imports_of(path, module_name(path, runtime), "bench")]
    for path in sorted((root / "bench").rglob("*.py")):
        problems += [f"{where}: a private afd name (make it public in afd, or keep the logic in the bench)"
                     for where in private_afd_names(path)]
    return problems


def test_bench_imports_point_down_to_its_harness_and_use_public_afd_names_only():
    problems = bench_problems()
    assert not problems, "\n".join(problems)


def _write_bench(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_bench_import_pointing_up_a_cycle_an_afd_import_of_bench_and_a_private_name_are_named(tmp_path):
    root = _write_bench(tmp_path, {
        "bench/__init__.py": "", "bench/harness/__init__.py": "", "bench/kernels/__init__.py": "",
        "bench/step/__init__.py": "",
        "bench/harness/measure.py": "def f():\n    from bench.kernels import moe\n",
        "bench/kernels/moe.py": "from afd.kernels import moe_triton, _hidden\nimport afd.kernels._x\n"
                                "k = moe_triton._down\nfrom bench.harness import measure\n",
        "bench/step/a.py": "from bench.step import b\nfrom afd.x import public\npublic.fine()\n",
        "bench/step/b.py": "import bench.step.a\n",
        "runtime/afd/__init__.py": "", "runtime/afd/cli.py": "def f():\n    import bench.step.a\n"})
    layers = (("step", frozenset({"step"})), ("kernels", frozenset({"kernels"})),
              ("harness", frozenset({"harness", "__init__"})))
    problems = bench_problems(root, root / "runtime", layers)
    moe = root / "bench" / "kernels" / "moe.py"
    assert problems == [
        "bench.harness.measure (line 2, 'harness') imports bench.kernels ('kernels', above it)",
        "bench.harness.measure (line 2, 'harness') imports bench.kernels.moe ('kernels', above it)",
        "modules import each other: bench.harness.measure ⇄ bench.kernels.moe",
        "modules import each other: bench.step.a ⇄ bench.step.b",
        "afd.cli (line 2) imports bench.step.a: afd never imports a benchmark",
        f"{moe}:1: afd.kernels._hidden: a private afd name (make it public in afd, or keep the logic in the bench)",
        f"{moe}:2: afd.kernels._x: a private afd name (make it public in afd, or keep the logic in the bench)",
        f"{moe}:3: moe_triton._down: a private afd name (make it public in afd, or keep the logic in the bench)"]
    assert bench_problems(root, root / "runtime", (("x", frozenset({"harness", "__init__"})),)) == [
        "bench/kernels is in no layer: add it to BENCH_LAYERS", "bench/step is in no layer: add it to BENCH_LAYERS"]
