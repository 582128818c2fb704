"""The config of `afd up` and `afd generate`: everything `afd serve` reads (a settings file, `AFD_*`, flags),
less what a local group decides itself; a source that sets one of those is refused by name, not dropped.
Torch-free."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from afd.config.load import load_config
from afd.config.settings import AFDConfig

TOPOLOGY_SETTINGS = ("num_attention_ranks", "num_ffn_ranks", "ffn_expert_parallel")
# every rank on 127.0.0.1, each FFN process on its own pair of ports (the children get the real ports)
LOCAL_PLACEMENT = {"ffn_address_template": "127.0.0.1", "port_stride": 2}


def decided_settings(command: str, monolithic: bool) -> dict[str, str]:
    """Settings `afd <command>` sets itself (setting → why a user may not)."""
    ports = f"afd {command} picks free ports on 127.0.0.1 for every rank" + (
        " (--port sets the front door's)" if command == "up" else "")
    decided = {
        "role": f"afd {command} starts every role itself (--monolithic: one process with the whole model)",
        "rank": f"afd {command} numbers its ranks itself",
        "ffn_shard": f"afd {command} numbers the shards of its FFN ranks itself",
        **dict.fromkeys(("control_port", "data_port", "port_stride", "http_port", "metrics_port"), ports),
        **dict.fromkeys(("ffn_address_template", "bind_host", "http_host"), f"afd {command} runs every rank on 127.0.0.1"),
    }
    if command == "up":
        decided["connector"] = "afd up connects its ranks over zmq"
    if monolithic:
        decided.update(dict.fromkeys(TOPOLOGY_SETTINGS, "--monolithic runs the whole model in one process"))
    return decided


def local_config(command: str, flags: Mapping[str, Any], defaults: Mapping[str, Any], monolithic: bool,
                 file: str | None = None, env: Mapping[str, str] | None = None) -> AFDConfig:
    """The group's config as `afd serve` builds one (`load_config`): the command's `defaults` < `file` < `env`
    < `flags` (None: not given), refusing what `decided_settings` names. The model path is made absolute."""
    fixed: dict[str, Any] = {**LOCAL_PLACEMENT, "role": "monolithic" if monolithic else "attention"}
    if monolithic:
        fixed.update(num_attention_ranks=1, num_ffn_ranks=1, ffn_expert_parallel=1)
    config = load_config(cli=flags, env=env, file=file, defaults={**defaults, **fixed},
                         decided=decided_settings(command, monolithic))
    model = config.load.model
    return config.replace(model=str(Path(model).resolve())) if model else config
