"""The runtime configuration of one role process, read once at the process edge, and every `AFD_*` variable.

Sources, later ones winning: defaults < a YAML/JSON file (`AFD_CONFIG_FILE` or
`--config`) < `AFD_*` environment variables (docs/configuration.md) < CLI flags. The result is a
frozen, validated `AFDConfig`; errors name the source and the bad value. Torch-free.

`AFDConfig` is made of sections (`GroupSettings`, `LinkSettings`, `SplitSettings`, `LoadSettings`,
`SchedulerSettings`, `KVCacheSettings`, `ApiSettings`, `GraphSettings`, `ProcessSettings`): entry points and
role builders read the whole config and hand each component the sections it reads, e.g. `config.link`. Each
setting is declared once, as a field of its section's class (`setting(...)`: help, bounds, the roles that read
it; allowed values as a `Literal` type). The environment table (`ENV_VARS`), the checks,
`afd serve`'s flags and --help, docs/configuration.md and the operator's defaults all derive from
`SETTINGS`. The few variables a process reads outside the config (a kernel choice, a library path, the
log level) are declared in `PROCESS_VARIABLES` and read only through `process_setting`.

The modules: `declare` (how a setting and a section are declared, `Setting`, the choice types), `sections`
(the section classes and their settings), `settings` (`AFDConfig`, its sections and checks, `SECTIONS`,
`SETTINGS`, `ENV_VARS`), `load` (file, environment and flags into a config, and
back into an environment), `local` (the config of `afd up` and `afd generate`) and `process` (the variables
outside the config). Import from `afd.config`.
"""

from afd.config.declare import (
    ATTENTION_ENGINES, CONNECTORS, DEVICES, DTYPES, KV_CACHE_DTYPES, MAX_API_SERVERS, MAX_EXPERT_PARALLEL, ROLES,
    STAGES, AttentionEngine, ConfigError, Connector, Device, Dtype, KVCacheDtype, Role, Setting, StageCount, section,
    setting, settings_of,
)
from afd.config.load import (
    config_to_env, load_config, setting_from_env, values_from_env, values_from_file, values_from_topology,
)
from afd.config.local import local_config
from afd.config.process import PROCESS_VARIABLES, ProcessVariable, process_setting
from afd.config.sections import (
    ApiSettings, GraphSettings, GroupSettings, KVCacheSettings, LinkSettings, LoadSettings, ProcessSettings,
    SchedulerSettings, SplitSettings,
)
from afd.config.settings import ENV_VARS, SECTION_TYPES, SECTIONS, SETTINGS, AFDConfig

__all__ = [
    "ATTENTION_ENGINES", "CONNECTORS", "DEVICES", "DTYPES", "ENV_VARS", "KV_CACHE_DTYPES", "MAX_API_SERVERS",
    "MAX_EXPERT_PARALLEL", "PROCESS_VARIABLES", "ROLES", "SECTIONS", "SECTION_TYPES", "SETTINGS", "STAGES", "AFDConfig", "ApiSettings",
    "AttentionEngine", "ConfigError", "Connector", "Device", "Dtype", "GraphSettings", "GroupSettings",
    "KVCacheDtype", "KVCacheSettings", "LinkSettings", "LoadSettings", "ProcessSettings", "ProcessVariable", "Role",
    "SchedulerSettings", "Setting", "SplitSettings", "StageCount", "config_to_env", "load_config", "local_config",
    "process_setting", "section", "setting", "setting_from_env", "settings_of", "values_from_env", "values_from_file",
    "values_from_topology",
]
