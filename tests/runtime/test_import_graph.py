"""`scripts/import_graph.py`, the command that prints the runtime's import arrows and cycles (issue 36)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "import_graph.py"


def test_it_names_an_arrow_pointing_up_the_cycles_and_the_silent_local_imports(tmp_path):
    files = {"__init__.py": "", "config.py": "", "server/__init__.py": "",
             "server/run.py": "from afd.engine import engine\nimport afd.config\n",
             "engine/__init__.py": "",
             "engine/engine.py": "def f():\n    from afd.server import run\n    import json  # local import: why\n"}
    for name, text in files.items():
        (tmp_path / "afd" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "afd" / name).write_text(text)
    shown = subprocess.run([sys.executable, str(SCRIPT), "--root", str(tmp_path / "afd")], capture_output=True,
                           text=True, check=True).stdout.splitlines()
    assert shown[0] == f"{tmp_path / 'afd'}: 6 modules in 4 units, 3 package arrows, 5 module imports of afd"
    assert shown[1:] == [
        "imports inside functions: 2, 1 with a '# local import: <reason>'",
        "units in no layer of LAYERS: none",
        "module imports pointing up the layer order: 2",
        "  afd.engine.engine:2 → afd.server  (engine → processes and tools)",
        "  afd.engine.engine:2 → afd.server.run  (engine → processes and tools)",
        "cycles between units: 1", "  engine ⇄ server",
        "cycles between modules: 1", "  afd.engine.engine ⇄ afd.server.run",
        "package arrows (importer → imported (modules of the importer that import it)):",
        "  server → engine (1), config (1)", "  engine → server (1)"]


def test_a_folder_without_the_runtime_is_refused(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--root", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 1 and "expected a folder holding afd/__init__.py" in result.stderr


def test_the_benchmarks_beside_the_runtime_get_their_figures_and_problems(tmp_path):
    files = {"runtime/afd/__init__.py": "", "runtime/afd/kernels/__init__.py": "", "runtime/afd/kernels/moe.py": "",
             "bench/__init__.py": "", "bench/harness/__init__.py": "", "bench/harness/measure.py": "",
             "bench/kernels/__init__.py": "",
             "bench/kernels/moe_layer.py": "from bench.harness.measure import f\nfrom afd.kernels import moe\n"
                                           "moe._table()\n",
             "bench/harness/shapes.py": "from bench.kernels import moe_layer\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    shown = subprocess.run([sys.executable, str(SCRIPT), "--root", str(tmp_path / "runtime"), "--summary"],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    bench = shown[shown.index(next(line for line in shown if line.startswith(str(tmp_path / "bench")))):]
    moe_layer = tmp_path / "bench" / "kernels" / "moe_layer.py"
    assert bench == [
        f"{tmp_path / 'bench'}: 6 modules in 2 folders, 3 module imports of bench, 2 of afd",
        "bench imports pointing up its order (comparisons with other systems > ranks together > serving > one step > "
        "kernels > harness): 2",
        "  bench.harness.shapes (line 1, 'harness') imports bench.kernels ('kernels', above it)",
        "  bench.harness.shapes (line 1, 'harness') imports bench.kernels.moe_layer ('kernels', above it)",
        "cycles between bench modules: 0", "afd modules importing bench: 0", "private afd names used by bench: 1",
        f"  {moe_layer}:3: moe._table: a private afd name (make it public in afd, or keep the logic in the bench)"]
