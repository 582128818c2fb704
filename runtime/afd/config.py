"""The runtime configuration of one role process, read once at the process edge, and every `AFD_*` variable.

Sources, later ones winning: defaults < a YAML/JSON file (`AFD_CONFIG_FILE` or
`--config`) < `AFD_*` environment variables (docs/configuration.md) < CLI flags. The result is a
frozen, validated `AFDConfig`; errors name the source and the bad value. Torch-free.

Each setting is declared once, as its `AFDConfig` field (`setting(...)`: help, section, bounds, the roles
that read it; allowed values as a `Literal` type). The environment table (`ENV_VARS`), the checks,
`afd serve`'s flags and --help, docs/configuration.md and the operator's defaults all derive from
`SETTINGS`. The few variables a process reads outside the config (a kernel choice, a library path, the
log level) are declared in `PROCESS_VARIABLES` and read only through `process_setting` here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Literal, Mapping, get_args, get_origin, get_type_hints

from afd.topology import Topology, TopologyError

# The allowed values of the settings that name a choice; the tuples are what other modules check against.
Role = Literal["attention", "ffn", "monolithic"]  # monolithic: one process, the FFN local (afd.monolithic)
Connector = Literal["loopback", "zmq", "nccl"]
StageCount = Literal[1, 2]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
AttentionEngine = Literal["afd", "vllm"]  # vllm: the attention pod runs vLLM with afd.vllm_plugin
ROLES: tuple[str, ...] = get_args(Role)
CONNECTORS: tuple[str, ...] = get_args(Connector)
STAGES: tuple[int, ...] = get_args(StageCount)
DTYPES: tuple[str, ...] = get_args(Dtype)
DEVICES: tuple[str, ...] = get_args(Device)
ATTENTION_ENGINES: tuple[str, ...] = get_args(AttentionEngine)
MAX_EXPERT_PARALLEL = 64
MAX_API_SERVERS = 16  # API processes of one rank

# The sections settings are grouped in (docs/configuration.md, `afd serve --help`, `AFDConfig.section`).
SECTIONS: dict[str, str] = {
    "group": "The group: role, rank, shape, identity",
    "link": "The attention-FFN link",
    "stages": "Micro-batches and the router",
    "model": "Model and engine",
    "scheduler": "The scheduler",
    "kv": "The KV cache",
    "api": "The OpenAI API",
    "graphs": "CUDA graphs and the start-up ceiling",
    "process": "Probes, metrics, shutdown",
}
A, F, M = ROLES  # the roles that read a setting (`roles=`)


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names it."""


def setting(default: Any, help: str, *, section: str, roles: tuple[str, ...] = ROLES, ge: float | None = None,
            gt: float | None = None, le: float | None = None, check: Callable[[Any], str | None] | None = None,
            flag: bool = True, secret: bool = False) -> Any:
    """Declare one `AFDConfig` field and everything derived from it. Its variable is `AFD_` + the name in
    capitals and its flag `--the-name`; `help` is its line in docs/configuration.md and `afd serve --help`;
    `ge`/`gt`/`le` bound a number (every number needs one: a test); a `Literal` type lists the allowed values;
    `check` says what is wrong with a value, or None; `roles` read it; `flag=False`: no `afd serve` flag (the rank
    counts: `--topology` sets them); `secret`: no flag, not in repr, no default shown."""
    metadata = {"help": help, "section": section, "roles": roles, "ge": ge, "gt": gt, "le": le, "check": check,
                "flag": flag and not secret, "secret": secret}
    return field(default=default, repr=not secret, metadata=metadata)


def _positive_ints(text: str) -> str | None:
    """positive integers, comma-separated"""
    if any(not b.strip().isdigit() or int(b) < 1 for b in filter(None, str(text).split(","))):
        return "must be positive integers separated by commas"
    return None


@dataclass(frozen=True)
class AFDConfig:
    """Everything a role process needs to know: one flat field per setting (grouped views: `section`)."""

    role: Role = setting("attention", "`attention`, `ffn`, or `monolithic` (one process, the FFN local, same engine "
                         "and API: the A/B baseline).", section="group")
    rank: int = setting(0, "Rank within the role. Unset in a pod: the StatefulSet ordinal at the end of `$HOSTNAME`.",
                        section="group", ge=0)
    num_attention_ranks: int = setting(1, "Attention ranks in the group (A of xAyF).", section="group",
                                       roles=(A, F), gt=0, flag=False)
    num_ffn_ranks: int = setting(1, "FFN ranks in the group (F of xAyF); attention rank a maps to FFN rank a // (A/F).",
                                 section="group", roles=(A, F), gt=0, flag=False)
    ffn_expert_parallel: int = setting(  # docs/expert-parallel.md
        1, "Shards per FFN rank (G): shard s holds routed experts [s·E/G, (s+1)·E/G) and 1/G of the shared-expert "
        "columns (dense layers: shard 0); attention sums the G partial outputs (docs/expert-parallel.md).",
        section="group", roles=(A, F), ge=1, le=MAX_EXPERT_PARALLEL)
    ffn_shard: int = setting(0, "FFN role: this process's shard of its rank. Unset in a pod with G > 1: the ordinal is "
                             "rank·G + shard.", section="group", roles=(F,), ge=0)
    ffn_address_template: str = setting(
        "127.0.0.1", "Host of FFN process `{rank}` (its pod ordinal: rank·G + shard with expert parallelism), "
        "e.g. `demo-g0-ffn-{rank}.demo-g0-ffn.ns.svc`.", section="link", roles=(A,))
    control_port: int = setting(25500, "FFN control-plane port (zmq: Hello, StepPlan, Heartbeat, Goodbye).",
                                section="link", roles=(A, F), ge=1, le=65535)
    data_port: int = setting(25501, "FFN data-plane port (zmq frames; with nccl, only the NCCL bootstrap).",
                             section="link", roles=(A, F), ge=1, le=65535)
    port_stride: int = setting(0, "Added to both ports per FFN rank, so several FFN ranks can share one host "
                               "(local runs).", section="link", roles=(A, F), ge=0)
    bind_host: str = setting("0.0.0.0", "Address the FFN rank listens on.", section="link", roles=(F,))
    max_message_bytes: int = setting(1 << 30, "Largest control or data message accepted; larger ones are refused and "
                                     "counted.", section="link", roles=(A, F), gt=0)
    connector: Connector = setting("zmq", "`zmq` (any network, CPU or GPU), `nccl` (GPU data plane, zmq control "
                                   "plane) or `loopback` (tests).", section="link", roles=(A, F))
    stages: StageCount = setting(1, "Micro-batches per layer: 1, or 2 for dual-batch overlap (attention computes one "
                                 "while the FFN runs the other).", section="stages", roles=(A, F))
    gate_on_attention: bool = setting(False, "`true`: the MoE router runs on attention and ships router logits; dense "
                                      "layers stay on attention.", section="stages")
    model: str = setting("", "Checkpoint folder (a Hugging Face DeepSeek-V2, DeepSeek-V3/Kimi-K2 or Qwen3-MoE layout; "
                         "FP8 block-quantized too).", section="model")
    dtype: Dtype = setting("auto", "`auto` (bfloat16 on CUDA, float32 on CPU), `float32`, `bfloat16` or `float16`.",
                           section="model")
    device: Device = setting("auto", "`auto`, `cpu` or `cuda`.", section="model")
    http_host: str = setting("0.0.0.0", "Address of the OpenAI-compatible API (attention ranks).", section="api",
                             roles=(A, M))
    http_port: int = setting(8000, "Port of the OpenAI-compatible API (attention ranks).", section="api", roles=(A, M),
                             ge=1, le=65535)
    metrics_port: int = setting(9090, "Port of `/metrics`, `/health` (readiness), `/live` and `/drain` (preStop) "
                                "(both roles; the probes use it).", section="process", ge=1, le=65535)
    max_num_seqs: int = setting(64, "Most sequences in one engine step; also the largest decode graph.",
                                section="scheduler", gt=0)
    max_model_len: int = setting(0, "Longest prompt + output in tokens (0: the model's `max_position_embeddings`).",
                                 section="scheduler", roles=(A, M), ge=0)
    max_num_batched_tokens: int = setting(8192, "Most tokens (prefill + decode) in one engine step.",
                                          section="scheduler", gt=0)
    prefill_itl_ratio: float = setting(  # 0: off, the default (issue 33)
        0.0, "While requests decode, a step takes only as many prompt tokens as keep its predicted time within this "
        "multiple of a decode-only step's (both learned from the rank's own steps), so arriving prompts do not stretch "
        "the running streams' inter-token latency; but at least 32, and enough that every prompt is in within "
        "`prefill_backlog_steps` steps of being queued (below 1: only those floors). No cap where no chunk is known "
        "to fit the ratio while as many requests wait for their first token as decode (a burst beside a few short "
        "decode steps). 0: off (prompts take all of `max_num_batched_tokens`). Exported as `afd_prefill_cap_tokens`.",
        section="scheduler", roles=(A, M), ge=0)
    prefill_backlog_steps: int = setting(
        64, "With `prefill_itl_ratio`: every waiting prompt is prefilled within N steps of being queued (a step beside "
        "decodes takes at least what the most pressed deadline needs). Larger N: steadier inter-token latency during "
        "bursts, later first tokens.", section="scheduler", roles=(A, M), gt=0)
    kv_cache_bytes: int = setting(
        0, "KV-cache budget of an attention rank in bytes (0: sized from the device, see `gpu_memory_utilization`; "
        "1 GiB on CPU). Capacity in tokens is logged at start and exported as `afd_kv_cache_capacity_tokens`.",
        section="kv", roles=(A, M), ge=0)
    served_model_name: str = setting("", "Model id the API answers to (default: the checkpoint folder's name).",
                                     section="api", roles=(A, M))
    failover_url: str = setting(
        "", "Attention: base URL (the client Service) where a request this rank answers with 503 before its first "
        "token is sent on, e.g. while its FFN is lost; empty: no failover. The operator sets it.",
        section="api", roles=(A,))
    max_request_bytes: int = setting(16 << 20, "Largest API request body; larger ones get 413 (refused from "
                                     "Content-Length or as it arrives).", section="api", roles=(A, M), gt=0)
    max_prompts: int = setting(128, "Most prompts in one `/v1/completions` request; more get 400.", section="api",
                               roles=(A, M), gt=0)
    max_prompt_chars: int = setting(0, "Most characters of one prompt (or of all chat messages) before tokenization "
                                    "(0: 32 per context token).", section="api", roles=(A, M), ge=0)
    group_token: str = setting("", "Identifies the AFD group; a peer of another group is refused at the handshake.",
                               section="group", roles=(A, F))
    group_secret: str = setting("", "Shared secret of the group (from the operator's Secret); proves a peer in the "
                                "handshake, never sent or logged.", section="group", roles=(A, F), secret=True)
    connect_timeout_s: float = setting(60.0, "How long an attention rank waits for its FFN rank at start-up and on "
                                       "reconnect.", section="link", roles=(A,), gt=0)
    peer_timeout_s: float = setting(5.0, "A peer silent this long is lost (an FFN rank's requests are then held for "
                                    "`ffn_hold_s`).", section="link", roles=(A, F), gt=0)
    ffn_hold_s: float = setting(
        60.0, "Attention: when the FFN rank is lost, its requests are held (KV cache intact) this many seconds for it "
        "(its restarted pod, at the same address) to come back, and go on from where they stopped, with no error and "
        "no token lost or sent twice; past it they fail with an error event (0: at once).",
        section="link", roles=(A,), ge=0)
    heartbeat_interval_s: float = setting(1.0, "Heartbeat period between steps.", section="link", roles=(A, F), gt=0)
    shutdown_grace_s: float = setting(30.0, "On SIGTERM, how long in-flight requests may finish before they are "
                                      "failed.", section="process", roles=(A, M), gt=0)
    profile_every: int = setting(16, "Per-layer timings on every N-th step (0: off).", section="process", ge=0)
    cuda_graphs: bool = setting(False, "`true`: decode graphs on attention and a step-graph cache on the FFN (CUDA "
                                "with the nccl connector).", section="graphs")
    mixed_graph_tokens: int = setting(
        2048, "With `cuda_graphs` (monolithic and attention ranks): steps that carry prompt tokens, up to this many "
        "tokens (and `max_num_batched_tokens`), replay piecewise graphs: everything between two attention kernels "
        "captured per padded token bucket, attention eager; an attention rank's FFN rank replays its whole-step graph "
        "for the bucket. About 0.5 MiB of graph pool per token at DeepSeek-V2-Lite shapes, kept out of the KV cache. "
        "`0`: such steps run eagerly.", section="graphs", roles=(A, M), ge=0)
    ffn_batch_window_s: float = setting(0.0, "FFN: wait up to this long for every peer's plan so their rows share one "
                                        "step.", section="link", roles=(F,), ge=0)
    dbo_min_tokens: int = setting(0, "With 2 stages, steps of fewer tokens run as one micro-batch (the FFN then reads "
                                  "its weights once).", section="stages", roles=(A,), ge=0)
    attention_engine: AttentionEngine = setting("afd", "`afd` (our engine) or `vllm` (vLLM's OpenAI server with "
                                                "`afd.vllm_plugin`).", section="model", roles=(A,))
    vllm_args: str = setting("", "Extra arguments for vLLM's server when `attention_engine` is `vllm`, shell-quoted.",
                             section="model", roles=(A,))
    gpu_memory_utilization: float = setting(
        0.9, "With `kv_cache_bytes` 0 on a GPU: the KV cache takes this fraction of the GPU's memory, less what is in "
        "use after loading the weights, the peak of the largest step (`max_num_batched_tokens`, profiled at start) "
        "and 1 GiB for the decode graphs (vLLM's `--gpu-memory-utilization`).", section="kv", roles=(A, M), gt=0, le=1)
    ceiling_batches: str = setting(
        "", "Comma-separated batch sizes whose graph-replayed decode step is timed at start (log and "
        "`afd_step_ceiling_seconds`; the serving benchmark's ceiling). Empty: off.", section="graphs", roles=(A, M),
        check=_positive_ints)
    ceiling_context: int = setting(704, "Cached tokens of every sequence in the start-up ceiling's timed steps "
                                   "(`ceiling_batches`); the serving benchmark sets its load's mean context.",
                                   section="graphs", roles=(A, M), gt=0)
    api_process: bool = setting(
        False, "`true`: the OpenAI API (uvicorn, tokenization, SSE) runs in a child process and talks to the engine "
        "core over local zmq sockets, so the HTTP work does not hold the engine's GIL; probes and `/metrics` stay on "
        "`metrics_port` in the core. `false`: one process.", section="api", roles=(A, M))
    api_servers: int = setting(
        1, "How many API processes share the HTTP port (SO_REUSEPORT: the kernel spreads connections over them), each "
        "its own event loop and core of CPU, like vLLM's `--api-server-count`; more than 1 implies `api_process`.",
        section="api", roles=(A, M), ge=1, le=MAX_API_SERVERS)

    def __post_init__(self) -> None:
        for spec in SETTINGS.values():  # every field against its own declaration: choices, bounds, format
            spec.check(getattr(self, spec.name))
        try:
            topology = self.topology
        except TopologyError as err:
            raise ConfigError(str(err)) from None
        size = topology.num_ffn if self.role == "ffn" else topology.num_attention
        if not 0 <= self.ffn_shard < self.ffn_expert_parallel:
            raise ConfigError(f"ffn_shard={self.ffn_shard}: must be in 0..{self.ffn_expert_parallel - 1} "
                              f"for ffn_expert_parallel={self.ffn_expert_parallel}")
        if not 0 <= self.rank < size:
            raise ConfigError(f"rank={self.rank}: a {self.role} rank must be in 0..{size - 1} for {topology}")
        if self.num_ffn_ranks * self.ffn_expert_parallel > 1 and "{rank}" not in self.ffn_address_template and not self.port_stride:
            raise ConfigError(
                f"ffn_address_template={self.ffn_address_template!r} has no '{{rank}}' and port_stride=0: "
                f"all {self.num_ffn_ranks * self.ffn_expert_parallel} FFN processes would share one address"
            )

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

    def section(self, name: str) -> SimpleNamespace:
        """The settings of one of `SECTIONS` (link, stages, scheduler, kv, api, graphs, ...) as a read-only copy,
        e.g. `config.section("link").peer_timeout_s`; the fields themselves stay flat on the config."""
        if name not in SECTIONS:
            raise KeyError(f"no section {name!r}: one of {', '.join(SECTIONS)}")
        return SimpleNamespace(**{s.name: getattr(self, s.name) for s in SETTINGS.values() if s.section == name})

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


@dataclass(frozen=True)
class Setting:
    """One setting as its `AFDConfig` field declares it, with what derives from its name and type."""

    name: str
    type: type  # bool, int, float or str: what a variable's text is parsed as
    default: Any
    help: str
    section: str
    roles: tuple[str, ...]
    choices: tuple = ()  # from a Literal type
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    check_value: Callable[[Any], str | None] | None = None
    flag: bool = True
    secret: bool = False

    @property
    def env(self) -> str:
        return "AFD_" + self.name.upper()

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def bounded(self) -> bool:
        return bool(self.choices) or any(bound is not None for bound in (self.ge, self.gt, self.le))

    @property
    def allowed(self) -> str:
        """The allowed values in words ('' where any value of the type is)."""
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        if self.le is not None:
            low = f"({self.gt:g}, " if self.gt is not None else f"{self.ge:g}.." if self.ge is not None else "up to "
            return f"in {low}{self.le:g}{']' if self.gt is not None else ''}"
        if self.gt == 0:
            return "positive"
        if self.ge == 0:
            return "not negative"
        if self.ge is not None or self.gt is not None:
            return f"at least {self.ge:g}" if self.ge is not None else f"above {self.gt:g}"
        return (self.check_value.__doc__ or "") if self.check_value else ""  # a check's docstring says what it takes

    def check(self, value: Any) -> None:
        """Refuse a value outside the declared choices, bounds or format, naming the setting and the value."""
        if self.choices and value not in self.choices:
            raise ConfigError(f"{self.name}={value!r}: must be {self.allowed}")
        low_ok = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        if not (low_ok and (self.le is None or value <= self.le)):
            raise ConfigError(f"{self.name}={value}: must " + ("not be negative" if self.ge == 0 and self.le is None
                                                               else f"be {self.allowed}"))
        problem = self.check_value(value) if self.check_value else None
        if problem:
            raise ConfigError(f"{self.name}={value!r}: {problem}")


def _settings(cls: type = AFDConfig) -> dict[str, Setting]:
    """The declarations of `cls`'s fields; a field declared without `setting(...)`, or a number without a bound,
    is refused here, at import, before any process can run with an unchecked setting."""
    hints = get_type_hints(cls)
    table = {}
    for f in fields(cls):
        meta, hint = f.metadata, hints[f.name]
        if "help" not in meta:
            raise TypeError(f"AFDConfig.{f.name}: declare it with setting(default, help, section=...)")
        choices = get_args(hint) if get_origin(hint) is Literal else ()
        table[f.name] = spec = Setting(
            name=f.name, type=type(choices[0]) if choices else hint, default=f.default, help=meta["help"],
            section=meta["section"], roles=meta["roles"], choices=choices, ge=meta["ge"], gt=meta["gt"], le=meta["le"],
            check_value=meta["check"], flag=meta["flag"], secret=meta["secret"])
        if spec.type not in (bool, int, float, str) or spec.section not in SECTIONS:
            raise TypeError(f"AFDConfig.{f.name}: a bool, int, float, str or Literal in one of {', '.join(SECTIONS)}")
        if spec.type in (int, float) and not spec.bounded:
            raise TypeError(f"AFDConfig.{f.name}: a number needs bounds (ge=, gt= or le=) or a Literal type")
    return table


SETTINGS: dict[str, Setting] = _settings()  # field name → its declaration, in field order
ENV_VARS: dict[str, str] = {spec.env: name for name, spec in SETTINGS.items()}  # AFD_* variable → field


def _parse_bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


_PARSERS: dict[type, Callable[[Any], Any]] = {int: int, float: float, bool: _parse_bool, str: str}
_ORDINAL_RE = re.compile(r"-(\d+)$")


def _coerce(source: str, name: str, raw: Any) -> Any:
    if name not in SETTINGS:
        raise ConfigError(f"{source}: unknown setting {name!r}")
    kind = SETTINGS[name].type
    try:
        return _PARSERS[kind](raw)
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


@dataclass(frozen=True)
class ProcessVariable:
    """An `AFD_*` variable outside `AFDConfig`: read where it is used (a kernel choice, a library path, the log
    level), by `afd up` or the operator, always through `process_setting`, and not passed on by `config_to_env`."""

    name: str
    default: str  # the text an unset or empty variable stands for
    help: str
    read_by: str
    choices: tuple[str, ...] = ()
    parse: Callable[[str], Any] = str


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be positive seconds")
    return value


def _path(text: str) -> Path:
    return Path(text).expanduser()  # depends on $HOME too: never cached


def _level(text: str) -> str:
    import logging  # stdlib; only here, where a level name is checked

    name = text.strip().upper()
    if not isinstance(logging.getLevelName(name), int):
        raise ValueError("must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return name


PROCESS_VARIABLES: dict[str, ProcessVariable] = {v.name: v for v in (
    ProcessVariable("AFD_CONFIG_FILE", "", "YAML/JSON settings file (keys: the setting names above), below the "
                    "environment and flags; `--config` of the commands.", "afd serve, up, generate", parse=str),
    ProcessVariable("AFD_TOPOLOGY", "", "Both rank counts at once, e.g. `2A1F` (wins over `AFD_NUM_ATTENTION_RANKS` "
                    "and `AFD_NUM_FFN_RANKS`); `--topology` of the commands.", "afd serve, up, generate"),
    ProcessVariable("AFD_LOG_LEVEL", "", "Python log level (`DEBUG` … `CRITICAL`); unset: `INFO` for `afd serve`, "
                    "`WARNING` for the other commands.", "afd (every command)", parse=_level),
    ProcessVariable("AFD_SWITCH_INTERVAL_S", "", "Experiment: the interpreter's GIL hand-off interval "
                    "(`sys.setswitchinterval`) of `afd serve`; unset: Python's 0.005 s.", "afd serve", parse=_seconds),
    ProcessVariable("AFD_MOE_KERNEL", "auto", "Routed-expert kernel: `triton` (fused, CUDA), `grouped` (torch's "
                    "grouped GEMM) or `auto` (triton where Triton runs).", "afd.kernels.moe",
                    choices=("auto", "triton", "grouped")),
    ProcessVariable("AFD_FP8_GEMM", "auto", "FP8 block-scaled GEMM: `scaled_mm` (torch, Hopper), `triton` or `auto` "
                    "(scaled_mm on Hopper where the shapes fit).", "afd.kernels.fp8_gemm",
                    choices=("auto", "scaled_mm", "triton")),
    ProcessVariable("AFD_FUSED_GLUE", "true", "`false`: the torch path instead of the fused RMSNorm/RoPE glue kernels "
                    "on CUDA.", "afd.kernels.norm_rope", parse=_parse_bool),
    ProcessVariable("AFD_NCCL_LIBRARY", "", "Path of the libnccl to load first (else the one torch loaded, then "
                    "`nvidia.nccl`'s).", "afd.connector.transports.nccl.lib"),
    ProcessVariable("AFD_CACHE_DIR", "~/.cache/afd", "Where `afd up` keeps the tiny model it makes on first use.",
                    "afd up", parse=_path),
    ProcessVariable("AFD_OPERATOR_RESYNC_SECONDS", "10", "How often the operator reconciles every AFDDeployment "
                    "without an event.", "afd operator", parse=_seconds),
)}


_PARSED: dict[tuple[str, str], Any] = {}  # (variable, text) → value: kernels ask on every call


def process_setting(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The typed value of process variable `name` (`PROCESS_VARIABLES`) from `env` (default: this process's
    environment, read now, not at import); a bad value is a `ConfigError` naming the variable."""
    raw = (os.environ if env is None else env).get(name, "")
    if (name, raw) in _PARSED:
        return _PARSED[name, raw]
    variable = PROCESS_VARIABLES[name]
    text = raw or variable.default
    if variable.choices and text not in variable.choices:
        raise ConfigError(f"{name}={text!r}: must be one of {', '.join(variable.choices)}")
    try:
        value = variable.parse(text) if text else text
    except ValueError as err:
        raise ConfigError(f"{name}={text!r}: {err}") from None
    if variable.parse is not _path:
        _PARSED[name, raw] = value
    return value
