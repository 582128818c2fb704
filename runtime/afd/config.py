"""The runtime configuration of one role process, read once at the process edge.

Sources, later ones winning: defaults < a YAML/JSON file (`AFD_CONFIG_FILE` or
`--config`) < `AFD_*` environment variables (docs/configuration.md) < CLI flags. The result is a
frozen, validated `AFDConfig`; errors name the source and the bad value. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from afd.topology import Topology, TopologyError

ROLES = ("attention", "ffn", "monolithic")  # monolithic: one process, the FFN local (afd.monolithic)
CONNECTORS = ("loopback", "zmq", "nccl")
STAGES = (1, 2)
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_ENGINES = ("afd", "vllm")
MAX_EXPERT_PARALLEL = 64  # vllm: the attention pod runs vLLM with afd.vllm_plugin
MAX_API_SERVERS = 16  # API processes of one rank


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names it."""


@dataclass(frozen=True)
class AFDConfig:
    """Everything a role process needs to know; see docs/configuration.md for the env names."""

    role: str = "attention"
    rank: int = 0
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    ffn_expert_parallel: int = 1  # shards per FFN rank, each holding 1/G of the routed experts (docs/expert-parallel.md)
    ffn_shard: int = 0  # FFN role: which shard of its rank this process is
    ffn_address_template: str = "127.0.0.1"
    control_port: int = 25500
    data_port: int = 25501
    port_stride: int = 0
    bind_host: str = "0.0.0.0"
    max_message_bytes: int = 1 << 30
    connector: str = "zmq"
    stages: int = 1
    gate_on_attention: bool = False
    model: str = ""
    dtype: str = "auto"
    device: str = "auto"
    http_host: str = "0.0.0.0"
    http_port: int = 8000
    metrics_port: int = 9090
    max_num_seqs: int = 64
    max_model_len: int = 0
    max_num_batched_tokens: int = 8192
    prefill_itl_ratio: float = 0.0  # a step with decodes takes prompt tokens up to this × a decode-only step's time (0: off, the default: issue 33)
    prefill_backlog_steps: int = 64  # ... but at least 1/N of the prompt tokens waiting (the backlog drains in ~N steps)
    kv_cache_bytes: int = 0
    served_model_name: str = ""
    failover_url: str = ""  # attention: where a request this rank cannot serve goes on (the client Service)
    max_request_bytes: int = 16 << 20  # API request bodies over this get 413
    max_prompts: int = 128  # prompts in one /v1/completions request
    max_prompt_chars: int = 0  # characters of a prompt before tokenization (0: 32 per context token)
    group_token: str = ""
    group_secret: str = field(default="", repr=False)  # from the operator's Secret; never logged, never sent
    connect_timeout_s: float = 60.0
    peer_timeout_s: float = 5.0
    ffn_hold_s: float = 60.0  # attention: a lost FFN rank's requests wait this long for it to come back, then fail (0: at once)
    heartbeat_interval_s: float = 1.0
    shutdown_grace_s: float = 30.0
    profile_every: int = 16  # per-layer timings on every N-th step (0: off)
    cuda_graphs: bool = False  # decode graphs on attention, a step-graph cache on the FFN (nccl connector, CUDA)
    mixed_graph_tokens: int = 2048  # with cuda_graphs: piecewise graphs for prompt steps up to this many tokens (0: off)
    ffn_batch_window_s: float = 0.0  # FFN: wait up to this long for every peer's plan so their rows share a step
    dbo_min_tokens: int = 0  # stages=2: steps of fewer tokens run as one micro-batch (the FFN reads its weights once)
    attention_engine: str = "afd"  # attention role: our engine, or vLLM's OpenAI server with afd.vllm_plugin
    vllm_args: str = ""  # extra arguments for vLLM's server (attention_engine=vllm), shell-quoted
    # serving loop and KV sizing (afd.engine, afd.server.run)
    gpu_memory_utilization: float = 0.9  # KV cache: this fraction of the GPU, less what is in use, unless kv_cache_bytes
    ceiling_batches: str = ""  # comma-separated batch sizes whose graph-replayed step time is measured at start
    ceiling_context: int = 704  # cached tokens of every sequence in those timed steps
    api_process: bool = False  # attention/monolithic: the HTTP API in its own process (afd.server.api_process)
    api_servers: int = 1  # API processes sharing the HTTP port (SO_REUSEPORT); more than 1 implies api_process

    def __post_init__(self) -> None:
        _check_choice("role", self.role, ROLES)
        _check_choice("connector", self.connector, CONNECTORS)
        _check_choice("stages", self.stages, STAGES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("device", self.device, DEVICES)
        _check_choice("attention_engine", self.attention_engine, ATTENTION_ENGINES)
        try:
            topology = self.topology
        except TopologyError as err:
            raise ConfigError(str(err)) from None
        size = topology.num_ffn if self.role == "ffn" else topology.num_attention
        if not 1 <= self.ffn_expert_parallel <= MAX_EXPERT_PARALLEL:
            raise ConfigError(f"ffn_expert_parallel={self.ffn_expert_parallel}: must be in 1..{MAX_EXPERT_PARALLEL}")
        if not 0 <= self.ffn_shard < self.ffn_expert_parallel:
            raise ConfigError(f"ffn_shard={self.ffn_shard}: must be in 0..{self.ffn_expert_parallel - 1} "
                              f"for ffn_expert_parallel={self.ffn_expert_parallel}")
        if not 0 <= self.rank < size:
            raise ConfigError(f"rank={self.rank}: a {self.role} rank must be in 0..{size - 1} for {topology}")
        for name in ("control_port", "data_port", "http_port", "metrics_port"):
            port = getattr(self, name)
            if not 1 <= port <= 65535:
                raise ConfigError(f"{name}={port}: must be a TCP port in 1..65535")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_message_bytes", "connect_timeout_s", "peer_timeout_s",
                     "heartbeat_interval_s", "shutdown_grace_s", "max_request_bytes", "max_prompts", "ceiling_context",
                     "prefill_backlog_steps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be positive")
        if self.num_ffn_ranks * self.ffn_expert_parallel > 1 and "{rank}" not in self.ffn_address_template and not self.port_stride:
            raise ConfigError(
                f"ffn_address_template={self.ffn_address_template!r} has no '{{rank}}' and port_stride=0: "
                f"all {self.num_ffn_ranks * self.ffn_expert_parallel} FFN processes would share one address"
            )
        for name in ("max_model_len", "port_stride", "kv_cache_bytes", "profile_every", "ffn_batch_window_s", "dbo_min_tokens",
                     "mixed_graph_tokens", "max_prompt_chars", "prefill_itl_ratio", "ffn_hold_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must not be negative")
        if not 1 <= self.api_servers <= MAX_API_SERVERS:
            raise ConfigError(f"api_servers={self.api_servers}: must be in 1..{MAX_API_SERVERS}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        if any(not b.strip().isdigit() or int(b) < 1 for b in filter(None, self.ceiling_batches.split(","))):
            raise ConfigError(f"ceiling_batches={self.ceiling_batches!r}: must be positive integers separated by commas")

    @property
    def api_children(self) -> int:
        """How many API processes this rank starts (0: the API runs in the engine's process)."""
        return self.api_servers if self.api_process or self.api_servers > 1 else 0

    @property
    def piecewise_graph_tokens(self) -> int:
        """The largest prompt step that replays piecewise graphs (0: none): `mixed_graph_tokens`, at most a step's
        token budget, and only with `cuda_graphs`."""
        return min(self.mixed_graph_tokens, self.max_num_batched_tokens) if self.cuda_graphs else 0

    @property
    def topology(self) -> Topology:
        return Topology(self.num_attention_ranks, self.num_ffn_ranks)

    def ffn_endpoint(self, ffn_rank: int, shard: int = 0) -> int:
        """Index of shard `shard` of FFN rank `ffn_rank` among the group's FFN processes (its pod ordinal)."""
        return ffn_rank * self.ffn_expert_parallel + shard

    def ffn_host(self, endpoint: int) -> str:
        """Host name of FFN process `endpoint` (`ffn_endpoint`; the rank itself without expert parallelism)."""
        return self.ffn_address_template.format(rank=endpoint)

    def ffn_ports(self, endpoint: int) -> tuple[int, int]:
        """(control, data) ports of FFN process `endpoint`; a stride keeps local processes apart."""
        offset = endpoint * self.port_stride
        return self.control_port + offset, self.data_port + offset

    def replace(self, **changes: Any) -> "AFDConfig":
        return dataclasses.replace(self, **changes)


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: must be one of {', '.join(map(str, choices))}")


def _parse_bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "int": int,
    "float": float,
    "bool": _parse_bool,
    "str": str,
}

# Environment variable → field (docs/configuration.md is generated from this table).
ENV_VARS: dict[str, str] = {
    "AFD_ROLE": "role",
    "AFD_RANK": "rank",
    "AFD_NUM_ATTENTION_RANKS": "num_attention_ranks",
    "AFD_NUM_FFN_RANKS": "num_ffn_ranks",
    "AFD_FFN_EXPERT_PARALLEL": "ffn_expert_parallel",
    "AFD_FFN_SHARD": "ffn_shard",
    "AFD_FFN_ADDRESS_TEMPLATE": "ffn_address_template",
    "AFD_CONTROL_PORT": "control_port",
    "AFD_DATA_PORT": "data_port",
    "AFD_PORT_STRIDE": "port_stride",
    "AFD_BIND_HOST": "bind_host",
    "AFD_MAX_MESSAGE_BYTES": "max_message_bytes",
    "AFD_CONNECTOR": "connector",
    "AFD_STAGES": "stages",
    "AFD_GATE_ON_ATTENTION": "gate_on_attention",
    "AFD_MODEL": "model",
    "AFD_DTYPE": "dtype",
    "AFD_DEVICE": "device",
    "AFD_HTTP_HOST": "http_host",
    "AFD_HTTP_PORT": "http_port",
    "AFD_METRICS_PORT": "metrics_port",
    "AFD_MAX_NUM_SEQS": "max_num_seqs",
    "AFD_MAX_MODEL_LEN": "max_model_len",
    "AFD_MAX_NUM_BATCHED_TOKENS": "max_num_batched_tokens",
    "AFD_PREFILL_ITL_RATIO": "prefill_itl_ratio",
    "AFD_PREFILL_BACKLOG_STEPS": "prefill_backlog_steps",
    "AFD_KV_CACHE_BYTES": "kv_cache_bytes",
    "AFD_SERVED_MODEL_NAME": "served_model_name",
    "AFD_FAILOVER_URL": "failover_url",
    "AFD_MAX_REQUEST_BYTES": "max_request_bytes",
    "AFD_MAX_PROMPTS": "max_prompts",
    "AFD_MAX_PROMPT_CHARS": "max_prompt_chars",
    "AFD_GROUP_TOKEN": "group_token",
    "AFD_GROUP_SECRET": "group_secret",
    "AFD_CONNECT_TIMEOUT_S": "connect_timeout_s",
    "AFD_PEER_TIMEOUT_S": "peer_timeout_s",
    "AFD_FFN_HOLD_S": "ffn_hold_s",
    "AFD_HEARTBEAT_INTERVAL_S": "heartbeat_interval_s",
    "AFD_SHUTDOWN_GRACE_S": "shutdown_grace_s",
    "AFD_PROFILE_EVERY": "profile_every",
    "AFD_CUDA_GRAPHS": "cuda_graphs",
    "AFD_MIXED_GRAPH_TOKENS": "mixed_graph_tokens",
    "AFD_FFN_BATCH_WINDOW_S": "ffn_batch_window_s",
    "AFD_DBO_MIN_TOKENS": "dbo_min_tokens",
    "AFD_ATTENTION_ENGINE": "attention_engine",
    "AFD_VLLM_ARGS": "vllm_args",
    "AFD_GPU_MEMORY_UTILIZATION": "gpu_memory_utilization",
    "AFD_CEILING_BATCHES": "ceiling_batches",
    "AFD_CEILING_CONTEXT": "ceiling_context",
    "AFD_API_PROCESS": "api_process",
    "AFD_API_SERVERS": "api_servers",
}

_FIELD_TYPES = {f.name: f.type for f in fields(AFDConfig)}
_ORDINAL_RE = re.compile(r"-(\d+)$")


def _coerce(source: str, name: str, raw: Any) -> Any:
    if name not in _FIELD_TYPES:
        raise ConfigError(f"{source}: unknown setting {name!r}")
    parser = _PARSERS[_FIELD_TYPES[name]]
    try:
        return parser(raw)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{source}={raw!r}: not a valid {_FIELD_TYPES[name]} ({err})") from None


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
        import yaml

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
    return next(var for var, name in ENV_VARS.items() if name == field_name)


def config_to_env(config: AFDConfig) -> dict[str, str]:
    """The `AFD_*` environment that makes `load_config` rebuild `config` (for child processes), whatever
    the parent's own environment holds: every variable, `AFD_TOPOLOGY` too, and no settings file."""
    env = {"AFD_TOPOLOGY": str(config.topology), "AFD_CONFIG_FILE": ""}
    for var, name in ENV_VARS.items():
        value = getattr(config, name)
        env[var] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return env
