"""`AFDConfig`: every setting of a role process, by section (`afd.config.sections`), each setting declared once
as a field of its section's class, checked against its declaration and across sections when built; `SECTIONS`,
`SETTINGS` and `ENV_VARS` derive from it. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, get_type_hints

from afd.config.declare import ConfigError, Setting, section, settings_of
from afd.config.sections import (
    ApiSettings, GraphSettings, GroupSettings, KVCacheSettings, LinkSettings, LoadSettings, ProcessSettings,
    SchedulerSettings, SplitSettings,
)
from afd.config.topology import TopologyError


@dataclass(frozen=True, init=False)
class AFDConfig:
    """Everything a role process needs to know, one section a field (`config.link.peer_timeout_s`). Built from flat
    settings, `AFDConfig(rank=1, peer_timeout_s=2.5)` (what a file, the environment and flags hold), and changed
    the same way, `config.replace(rank=2)`; entry points and role builders hand each component its sections."""

    group: GroupSettings = section("The group: role, rank, shape, identity")
    link: LinkSettings = section("The attention-FFN link")
    split: SplitSettings = section("Micro-batches and the router")
    load: LoadSettings = section("Model and engine")
    scheduler: SchedulerSettings = section("The scheduler")
    kv: KVCacheSettings = section("The KV cache")
    api: ApiSettings = section("The OpenAI API")
    graphs: GraphSettings = section("CUDA graphs and the start-up ceiling")
    process: ProcessSettings = section("Probes, metrics, shutdown")

    def __init__(self, **settings: Any) -> None:
        """The config of these settings (a setting's name → its value; the rest at their defaults), checked."""
        if unknown := [name for name in settings if name not in SETTINGS]:
            raise TypeError(f"AFDConfig: no setting {unknown[0]!r}")
        for name, kind in SECTION_TYPES.items():
            object.__setattr__(self, name, kind(**{key: value for key, value in settings.items()
                                                   if SETTINGS[key].section == name}))
        self._check()

    def _check(self) -> None:
        for spec in SETTINGS.values():  # every field against its own declaration: choices, bounds, format
            spec.check(self.value(spec.name))
        group, link = self.group, self.link
        try:
            topology = group.topology
        except TopologyError as err:
            raise ConfigError(str(err)) from None
        size = topology.num_ffn if group.role == "ffn" else topology.num_attention
        if not 0 <= group.ffn_shard < group.ffn_expert_parallel:
            raise ConfigError(f"ffn_shard={group.ffn_shard}: must be in 0..{group.ffn_expert_parallel - 1} "
                              f"for ffn_expert_parallel={group.ffn_expert_parallel}")
        if not 0 <= group.rank < size:
            raise ConfigError(f"rank={group.rank}: a {group.role} rank must be in 0..{size - 1} for {topology}")
        processes = group.num_ffn_ranks * group.ffn_expert_parallel
        if processes > 1 and "{rank}" not in link.ffn_address_template and not link.port_stride:
            raise ConfigError(
                f"ffn_address_template={link.ffn_address_template!r} has no '{{rank}}' and port_stride=0: "
                f"all {processes} FFN processes would share one address"
            )

    def value(self, name: str) -> Any:
        """The value of setting `name` (`SETTINGS`), read from its section."""
        return getattr(getattr(self, SETTINGS[name].section), name)

    def values(self) -> dict[str, Any]:
        """Every setting's value by its name, flat (what `AFDConfig(**...)` takes back)."""
        return {name: self.value(name) for name in SETTINGS}

    def replace(self, **changes: Any) -> "AFDConfig":
        """This config with some settings changed (by their names), checked again."""
        return AFDConfig(**{**self.values(), **changes})


SECTIONS: dict[str, str] = {f.name: f.metadata["title"] for f in fields(AFDConfig)}  # name → title, in order
SECTION_TYPES: dict[str, type] = {name: kind for name, kind in get_type_hints(AFDConfig).items() if name in SECTIONS}
SETTINGS: dict[str, Setting] = {  # setting name → its declaration, section by section
    name: spec for section_name, kind in SECTION_TYPES.items()
    for name, spec in settings_of(kind, section_name).items()}
if len(SETTINGS) != sum(len(fields(kind)) for kind in SECTION_TYPES.values()):
    raise TypeError("two sections declare a setting of one name")
ENV_VARS: dict[str, str] = {spec.env: name for name, spec in SETTINGS.items()}  # AFD_* variable → setting
