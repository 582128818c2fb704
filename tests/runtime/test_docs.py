"""The configuration reference in docs/ is generated from the code and must stay current."""

import dataclasses
import subprocess
import sys
from pathlib import Path

from afd.config import ENV_VARS, SECTION_TYPES, SETTINGS

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_has_an_env_variable_and_help():
    names = {f.name for kind in SECTION_TYPES.values() for f in dataclasses.fields(kind)}
    assert set(ENV_VARS.values()) == names == set(SETTINGS), "a section's field without an AFD_* variable, or the reverse"
    assert all(spec.help.strip() for spec in SETTINGS.values()), "declare each setting's help in its setting(...)"


def test_generated_docs_are_current():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_docs.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_user_facing_text_points_at_docs_not_at_a_design_brief_users_do_not_have():
    offenders = []
    for folder in ("runtime", "operator", "images", "charts", "README.md", "docs"):
        path = ROOT / folder
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and p.suffix in
                                                 (".py", ".md", ".yaml", ".json", "") and "__pycache__" not in p.parts]
        offenders += [str(p.relative_to(ROOT)) for p in files if "DESIGN §" in p.read_text(errors="replace")]
    assert not offenders, f"'DESIGN §' in {offenders}: point at docs/ instead"
