"""`afd.cli` is also the operator image's entry point (`afd operator`), which has no torch, msgpack or fastapi:
the CLI's module-level imports must load without them, and each import it defers says why (issue 36)."""

import ast
import subprocess
import sys
from pathlib import Path

CLI = Path(__file__).resolve().parents[2] / "runtime" / "afd" / "cli.py"
BLOCKER = """
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {"torch", "msgpack", "zmq", "fastapi", "uvicorn", "safetensors", "transformers", "httpx"}:
            raise ImportError("blocked " + name)
sys.meta_path.insert(0, Blocker())
"""


def test_the_cli_and_the_config_load_without_the_runtime_extras():
    code = BLOCKER + "import afd.cli; afd.cli.build_parser().parse_args(['serve', '--help'])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and "--max-num-seqs" in result.stdout, result.stderr[-2000:]


def test_every_deferred_import_of_the_cli_says_why():
    lines = CLI.read_text().splitlines()
    tree = ast.parse(CLI.read_text())
    top = {id(node) for node in tree.body}
    deferred = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top]
    assert deferred, "the finder found none: the CLI defers at least the torch-heavy commands"
    silent = [lines[node.lineno - 1].strip() for node in deferred if "#" not in lines[node.end_lineno - 1]]
    assert not silent, f"say why each import is deferred (torch, msgpack, fastapi...), or import it at the top: {silent}"
