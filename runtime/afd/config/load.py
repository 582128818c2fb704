"""Reading the settings of one process: from a file, the `AFD_*` environment and flags into one frozen
`AFDConfig` (`load_config`), and back into an environment for child processes (`config_to_env`). Torch-free.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from afd.config.declare import PARSERS, ConfigError
from afd.config.settings import ENV_VARS, SETTINGS, AFDConfig
from afd.config.topology import Topology, TopologyError

_ORDINAL_RE = re.compile(r"-(\d+)$")


def _coerce(source: str, name: str, raw: Any) -> Any:
    if name not in SETTINGS:
        raise ConfigError(f"{source}: unknown setting {name!r}")
    kind = SETTINGS[name].type
    try:
        return PARSERS[kind](raw)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{source}={raw!r}: not a valid {kind.__name__} ({err})") from None


def values_from_env(env: Mapping[str, str], hostname_rank: bool = True) -> dict[str, Any]:
    """Settings present in `env`, typed; `AFD_RANK` falls back to the `$HOSTNAME` ordinal (a pod's; not with
    `hostname_rank=False`, where the command numbers its ranks itself).

    An FFN pod of a rank of G shards (`AFD_FFN_EXPERT_PARALLEL`) is ordinal rank·G + shard.
    """
    values = {field: _coerce(var, field, env[var]) for var, field in ENV_VARS.items() if var in env}
    if "AFD_TOPOLOGY" in env:
        values.update(values_from_topology(env["AFD_TOPOLOGY"], source="AFD_TOPOLOGY"))
    if not hostname_rank:
        return values
    if "rank" not in values and (match := _ORDINAL_RE.search(env.get("HOSTNAME", ""))):
        ordinal, shards = int(match.group(1)), values.get("ffn_expert_parallel", 1)
        if values.get("role") == "ffn" and shards > 1 and "ffn_shard" not in values:
            values["rank"], values["ffn_shard"] = divmod(ordinal, shards)
        else:
            values["rank"] = ordinal
    return values


def values_from_topology(text: str, source: str = "topology") -> dict[str, int]:
    try:
        topology = Topology.parse(text)
    except TopologyError as err:
        raise ConfigError(f"{source}: {err}") from None
    return {"num_attention_ranks": topology.num_attention, "num_ffn_ranks": topology.num_ffn}


def values_from_file(path: str | Path) -> dict[str, Any]:
    """Settings from a YAML or JSON mapping whose keys are `AFDConfig` field names."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"config file {path}: cannot read it ({err.strerror})") from None
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings, got {type(data).__name__}")
    data = dict(data)
    values = values_from_topology(data.pop("topology"), f"{path}: topology") if "topology" in data else {}
    values.update({key: _coerce(f"{path}: {key}", key, raw) for key, raw in data.items()})
    return values


def load_config(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file: str | Path | None = None,
    defaults: Mapping[str, Any] | None = None,
    decided: Mapping[str, str] | None = None,
) -> AFDConfig:
    """Build the frozen config once: `defaults` < file < environment < CLI overrides (None: not given).

    One way for every command: `afd serve` passes only its flags; `afd up` and `afd generate` also pass
    their own `defaults` (e.g. 2A1F) and the settings they `decided` themselves (setting → why, e.g. every
    rank's ports): a file, variable or flag that sets one of those is refused with an error naming it,
    never silently dropped.
    """
    env = os.environ if env is None else env
    decided = decided or {}
    if unknown := set(decided) - set(SETTINGS):  # a command's own list must name settings that exist
        raise ValueError(f"decided: no such settings {sorted(unknown)}")
    file = file or env.get("AFD_CONFIG_FILE")
    from_file = values_from_file(file) if file else {}
    from_env = values_from_env(env, hostname_rank="rank" not in decided)
    from_cli = {key: _coerce(f"--{key.replace('_', '-')}", key, raw) for key, raw in (cli or {}).items() if raw is not None}
    sources = ((from_file, lambda key: f"{file}: {_FILE_KEY.get(key, key)}"),
               (from_env, lambda key: _env_name(key, env)),
               (from_cli, lambda key: _FLAG.get(key, f"--{key.replace('_', '-')}")))
    for values, name in sources:
        refused = [key for key in values if key in decided]
        if refused:
            key = refused[0]
            raise ConfigError(f"{name(key)}: {decided[key]}")
    return AFDConfig(**{**(defaults or {}), **from_file, **from_env, **from_cli})


_TOPOLOGY_FIELDS = ("num_attention_ranks", "num_ffn_ranks")
_FILE_KEY = {name: f"{name} (or topology)" for name in _TOPOLOGY_FIELDS}
_FLAG = {name: "--topology" for name in _TOPOLOGY_FIELDS}


def _env_name(field_name: str, env: Mapping[str, str]) -> str:
    """The variable that set `field_name` in `env` (AFD_TOPOLOGY wins over the rank counts)."""
    if field_name in _TOPOLOGY_FIELDS and "AFD_TOPOLOGY" in env:
        return "AFD_TOPOLOGY"
    return SETTINGS[field_name].env


def config_to_env(config: AFDConfig) -> dict[str, str]:
    """The `AFD_*` environment that makes `load_config` rebuild `config` (for child processes), whatever
    the parent's own environment holds: every variable, `AFD_TOPOLOGY` too, and no settings file."""
    env = {"AFD_TOPOLOGY": str(config.topology), "AFD_CONFIG_FILE": ""}
    for name, spec in SETTINGS.items():
        value = getattr(config, name)
        env[spec.env] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return env
