"""Each setting is declared once, a field of its section's class; everything else derives from that (issues 36, 50).

The environment table, the checks, `afd serve`'s flags and docs/configuration.md are read from
`afd.config.SETTINGS`; a field without a declaration, or a number without a bound, fails here. Every
`AFD_*` variable the runtime or the operator reads goes through `afd.config`.
"""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from afd import cli
from afd.config import (
    ENV_VARS, PROCESS_VARIABLES, ROLES, SECTION_TYPES, SECTIONS, SETTINGS, AFDConfig, ConfigError, LinkSettings,
    config_to_env, load_config, process_setting, setting, settings_of,
)

ROOT = Path(__file__).resolve().parents[2]
CODE = [ROOT / "runtime" / "afd", ROOT / "operator" / "afd_operator"]


def test_every_field_is_declared_with_help_section_roles_and_bounds():
    for spec in SETTINGS.values():
        assert spec.help.strip() and spec.section in SECTIONS, spec.name
        assert spec.roles and set(spec.roles) <= set(ROLES), spec.name
        if spec.type in (int, float):
            assert spec.bounded, f"{spec.name}: a number needs ge/gt/le (or a Literal type) in its setting(...)"
    assert {spec.section for spec in SETTINGS.values()} == set(SECTIONS), "a section without settings"


def test_a_plain_field_or_an_unbounded_number_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Plain(LinkSettings):
        new_knob: int = 3

    with pytest.raises(TypeError, match="new_knob: declare it with setting"):
        settings_of(Plain, "link")

    @dataclasses.dataclass(frozen=True)
    class Unbounded(LinkSettings):
        new_knob: int = setting(3, "a knob")

    with pytest.raises(TypeError, match="new_knob: a number needs"):
        settings_of(Unbounded, "link")
    assert settings_of(LinkSettings, "link") == {name: spec for name, spec in SETTINGS.items() if spec.section == "link"}


def _outside(spec):
    """Values just outside the declared bounds (each must be refused)."""
    step = 1 if spec.type is int else 0.5
    if spec.ge is not None:
        yield spec.ge - step
    if spec.gt is not None:
        yield spec.gt
    if spec.le is not None:
        yield spec.le + step


@pytest.mark.parametrize("name", [name for name, spec in SETTINGS.items() if spec.ge is not None or spec.gt is not None
                                  or spec.le is not None])
def test_every_bound_is_checked_and_named(name):
    spec = SETTINGS[name]
    for value in _outside(spec):
        with pytest.raises(ConfigError, match=f"^{name}="):
            load_config(env={spec.env: str(value)})
    inside = spec.ge if spec.ge is not None else spec.le if spec.le is not None else spec.gt + 1
    assert load_config(env={spec.env: str(inside), "AFD_RANK": "0"}).value(name) == inside


@pytest.mark.parametrize("name", [name for name, spec in SETTINGS.items() if spec.choices])
def test_every_choice_comes_from_the_literal_type(name):
    spec = SETTINGS[name]
    with pytest.raises(ConfigError, match=f"^{name}=.*must be one of"):
        AFDConfig(**{name: "nonsense" if spec.type is str else 99})
    assert {AFDConfig(**{name: choice}).value(name) for choice in spec.choices} == set(spec.choices)


def test_the_config_is_its_sections_built_from_flat_settings():
    config = AFDConfig(peer_timeout_s=2.5, max_num_seqs=7, rank=1, num_attention_ranks=2)
    assert config.link.peer_timeout_s == 2.5 and config.scheduler.max_num_seqs == 7 and config.group.rank == 1
    assert [field.name for field in dataclasses.fields(AFDConfig)] == list(SECTIONS) == list(SECTION_TYPES)
    for name, kind in SECTION_TYPES.items():  # each section a frozen class of its own settings, nothing else
        section = getattr(config, name)
        assert type(section) is kind and dataclasses.is_dataclass(section), name
        assert [field.name for field in dataclasses.fields(kind)] == [n for n, s in SETTINGS.items() if s.section == name]
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, dataclasses.fields(kind)[0].name, None)
    assert AFDConfig(**config.values()) == config and config_to_env(AFDConfig(**config.values())) == config_to_env(config)
    changed = config.replace(rank=0, stages=2)
    assert (changed.group.rank, changed.split.stages, changed.link) == (0, 2, config.link) and config.group.rank == 1
    with pytest.raises(TypeError, match="no setting 'link'"):
        AFDConfig(link=config.link)  # flat settings only: a section is not one
    with pytest.raises(ConfigError, match="^rank=2: a attention rank must be in 0..1 for 2A1F"):
        config.replace(rank=2)  # checked across sections again
    assert "group_secret" not in repr(AFDConfig(group_secret="hush"))


def test_serve_help_lists_every_setting_with_its_variable(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for spec in SETTINGS.values():
        if spec.flag:
            assert spec.flag_name in text and spec.env in text, spec.name
    assert "--group-secret" not in text  # a secret never goes on a command line


def test_every_serve_flag_reaches_the_config(monkeypatch):
    for var in [*ENV_VARS, "AFD_TOPOLOGY", "AFD_CONFIG_FILE"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AFD_MAX_NUM_SEQS", "3")  # a flag wins over the variable
    monkeypatch.setenv("HOSTNAME", "laptop")  # no pod ordinal

    def config_of(*argv):
        return cli.serve_config(cli.build_parser().parse_args(["serve", *argv]))

    for spec in SETTINGS.values():  # each flag sets its own setting, to a value other than the default
        if spec.flag and spec.choices:
            value = next(choice for choice in spec.choices if choice != spec.default)
            assert config_of(spec.flag_name, str(value)).value(spec.name) == value, spec.name
    config = config_of("--max-num-seqs", "7", "--cuda-graphs", "true", "--peer-timeout-s", "2.5",
                       "--ceiling-batches", "1,8", "--topology", "2A1F")
    assert (config.scheduler.max_num_seqs, config.graphs.cuda_graphs, config.link.peer_timeout_s,
            config.graphs.ceiling_batches) == (7, True, 2.5, "1,8")
    assert str(config.group.topology) == "2A1F" and config_of().scheduler.max_num_seqs == 3
    with pytest.raises(ConfigError, match="--max-num-seqs='x'"):
        config_of("--max-num-seqs", "x")


def test_process_variables_are_typed_checked_and_read_when_asked():
    assert process_setting("AFD_MOE_KERNEL", {}) == "auto"
    assert process_setting("AFD_MOE_KERNEL", {"AFD_MOE_KERNEL": "grouped"}) == "grouped"
    assert process_setting("AFD_FUSED_GLUE", {"AFD_FUSED_GLUE": "0"}) is False
    assert process_setting("AFD_OPERATOR_RESYNC_SECONDS", {}) == 10.0
    assert process_setting("AFD_CACHE_DIR", {"AFD_CACHE_DIR": "/tmp/x"}) == Path("/tmp/x")
    assert process_setting("AFD_LOG_LEVEL", {"AFD_LOG_LEVEL": "debug"}) == "DEBUG"
    for name, raw in (("AFD_MOE_KERNEL", "fast"), ("AFD_SWITCH_INTERVAL_S", "-1"), ("AFD_LOG_LEVEL", "loud")):
        with pytest.raises(ConfigError, match=f"^{name}='{raw}'"):
            process_setting(name, {name: raw})


def _module_strings(tree):
    """Module-level NAME = "text" constants (RESYNC_ENV = "AFD_..." read later by name)."""
    return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for target in node.targets if isinstance(target, ast.Name)}


def _env_reads(path):
    """(line, variable) of every os.environ[...] / .get(...) / os.getenv(...) of an AFD_* name in `path`."""
    tree = ast.parse(path.read_text())
    names = _module_strings(tree)

    def text(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return names.get(node.id) if isinstance(node, ast.Name) else None

    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ" or isinstance(node, ast.Name) and node.id == "environ"

    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            key = text(node.slice)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            if node.func.attr == "getenv" or node.func.attr in ("get", "pop", "setdefault") and is_environ(node.func.value):
                key = text(node.args[0])
        if key and key.startswith("AFD_"):
            yield node.lineno, key


def test_every_afd_variable_is_read_through_the_config_module():
    config = ROOT / "runtime" / "afd" / "config"
    offenders = [f"{path.relative_to(ROOT)}:{line} {name}" for folder in CODE for path in sorted(folder.rglob("*.py"))
                 if config not in path.parents for line, name in _env_reads(path)]
    assert not offenders, f"read these through afd.config.process_setting (or a setting): {offenders}"


def test_the_env_read_finder_finds_every_kind_of_read(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('import os\nNAME = "AFD_C"\nos.environ.get("AFD_A", "")\nos.environ["AFD_B"]\nos.getenv(NAME)\n'
                      'os.environ.get("HOME")\n')
    assert [name for _, name in _env_reads(sample)] == ["AFD_A", "AFD_B", "AFD_C"]


def test_every_afd_variable_named_in_the_code_is_declared():
    known = set(ENV_VARS) | set(PROCESS_VARIABLES)
    pattern = re.compile(r"\bAFD_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*])")
    unknown = set()
    for folder in CODE:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    unknown |= {f"{path.relative_to(ROOT)}: {n}" for n in pattern.findall(node.value) if n not in known}
    assert not unknown, f"declare these in afd.config (a setting or PROCESS_VARIABLES): {sorted(unknown)}"


def test_a_command_cannot_decide_a_setting_that_does_not_exist():
    with pytest.raises(ValueError, match="no such settings"):
        load_config(env={}, decided={"bind_hots": "a typo would silently refuse nothing"})
