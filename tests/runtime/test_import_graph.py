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
        "afd modules importing the whole config (AFDConfig) outside config/: 0 (at most 8)",
        "afd entry points loading it (load_config) to hand on its sections: 0",
        "package arrows (importer → imported (modules of the importer that import it)):",
        "  server → engine (1), config (1)", "  engine → server (1)"]


def test_a_folder_without_the_runtime_is_refused(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--root", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 1 and "expected a folder holding afd/__init__.py" in result.stderr
