"""The sections of a role process's settings, each a frozen class whose fields are its settings (`setting(...)`:
help, bounds, the roles that read it). `AFDConfig` is made of them and checks them when built; a component is
handed the sections it reads, never the whole config. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd.config.declare import (
    MAX_API_SERVERS, MAX_EXPERT_PARALLEL, AttentionEngine, Connector, Device, Dtype, KVCacheDtype, Role, StageCount, A, F,
    M, setting,
)
from afd.config.topology import Topology


REASONING_PARSERS = ("deepseek_r1", "qwen3", "deepseek_v3", "kimi_k2")  # afd.server.api.reasoning.PARSERS
TOOL_CALL_PARSERS = ("deepseek_v3", "deepseek_v31", "kimi_k2", "qwen3")  # afd.server.api.tool_parsers.PARSERS


def _positive_ints(text: str) -> str | None:
    """positive integers, comma-separated"""
    if any(not b.strip().isdigit() or int(b) < 1 for b in filter(None, str(text).split(","))):
        return "must be positive integers separated by commas"
    return None


def _reasoning_parser(name: str) -> str | None:
    """empty, deepseek_r1, qwen3, deepseek_v3 or kimi_k2"""
    return None if name in ("", *REASONING_PARSERS) else "must be empty or one of " + ", ".join(REASONING_PARSERS)


def _tool_call_parser(name: str) -> str | None:
    """empty (by architecture), none, deepseek_v3, deepseek_v31, kimi_k2 or qwen3"""
    allowed = ("", "none", *TOOL_CALL_PARSERS)
    return None if name in allowed else "must be empty, none or one of " + ", ".join(TOOL_CALL_PARSERS)


def _api_keys(text: str) -> str | None:
    """keys separated by commas: printable ASCII, no space (what an HTTP header carries as is)"""
    keys = [key.strip() for key in str(text).split(",")]
    if text and any(not key or not all("!" <= c <= "~" for c in key) for key in keys):
        return "must be keys separated by commas, each printable ASCII without spaces"
    return None


@dataclass(frozen=True)
class GroupSettings:
    """The group and this process's place in it: role, rank, the group's shape, its identity."""

    role: Role = setting("attention", "`attention`, `ffn`, or `monolithic` (one process, the FFN local, same engine "
                         "and API: the A/B baseline).")
    rank: int = setting(0, "Rank within the role. Unset in a pod: the StatefulSet ordinal at the end of `$HOSTNAME`.",
                        ge=0)
    num_attention_ranks: int = setting(1, "Attention ranks in the group (A of xAyF).", 
                                       roles=(A, F), gt=0, flag=False)
    num_ffn_ranks: int = setting(1, "FFN ranks in the group (F of xAyF); attention rank a maps to FFN rank a // (A/F).",
                                 roles=(A, F), gt=0, flag=False)
    ffn_expert_parallel: int = setting(  # docs/expert-parallel.md
        1, "Shards per FFN rank (G): shard s holds routed experts [s·E/G, (s+1)·E/G) and 1/G of the shared-expert "
        "columns (dense layers: shard 0); attention sums the G partial outputs (docs/expert-parallel.md).",
        roles=(A, F), ge=1, le=MAX_EXPERT_PARALLEL)
    ffn_shard: int = setting(0, "FFN role: this process's shard of its rank. Unset in a pod with G > 1: the ordinal is "
                             "rank·G + shard.", roles=(F,), ge=0)
    group_token: str = setting("", "Identifies the AFD group; a peer of another group is refused at the handshake.",
                               roles=(A, F))
    group_secret: str = setting("", "Shared secret of the group (from the operator's Secret); proves a peer in the "
                                "handshake, never sent or logged.", roles=(A, F), secret=True)

    @property
    def topology(self) -> Topology:
        return Topology(self.num_attention_ranks, self.num_ffn_ranks)

    def ffn_endpoint(self, ffn_rank: int, shard: int = 0) -> int:
        """Index of shard `shard` of FFN rank `ffn_rank` among the group's FFN processes (its pod ordinal)."""
        return ffn_rank * self.ffn_expert_parallel + shard

    @property
    def own_endpoint(self) -> int:
        """This FFN process's index among the group's FFN processes (`ffn_endpoint` of its rank and shard)."""
        return self.ffn_endpoint(self.rank, self.ffn_shard)


@dataclass(frozen=True)
class LinkSettings:
    """The attention-FFN link: where each FFN process listens, the connector, its limits and timings."""

    ffn_address_template: str = setting(
        "127.0.0.1", "Host of FFN process `{rank}` (its pod ordinal: rank·G + shard with expert parallelism), "
        "e.g. `demo-g0-ffn-{rank}.demo-g0-ffn.ns.svc`.", roles=(A,))
    control_port: int = setting(25500, "FFN control-plane port (zmq: Hello, StepPlan, Heartbeat, Goodbye).",
                                roles=(A, F), ge=1, le=65535)
    data_port: int = setting(25501, "FFN data-plane port (zmq frames; with nccl, only the NCCL bootstrap).",
                             roles=(A, F), ge=1, le=65535)
    port_stride: int = setting(0, "Added to both ports per FFN rank, so several FFN ranks can share one host "
                               "(local runs).", roles=(A, F), ge=0)
    bind_host: str = setting("0.0.0.0", "Address the FFN rank listens on.", roles=(F,))
    max_message_bytes: int = setting(1 << 30, "Largest control or data message accepted; larger ones are refused and "
                                     "counted.", roles=(A, F), gt=0)
    connector: Connector = setting("zmq", "`zmq` (any network, CPU or GPU), `nccl` (GPU data plane, zmq control "
                                   "plane) or `loopback` (tests).", roles=(A, F))
    connect_timeout_s: float = setting(60.0, "How long an attention rank waits for its FFN rank at start-up and on "
                                       "reconnect.", roles=(A,), gt=0)
    peer_timeout_s: float = setting(5.0, "A peer silent this long is lost (an FFN rank's requests are then held for "
                                    "`ffn_hold_s`).", roles=(A, F), gt=0)
    ffn_hold_s: float = setting(
        60.0, "Attention: when the FFN rank is lost, its requests are held (KV cache intact) this many seconds for it "
        "(its restarted pod, at the same address) to come back, and go on from where they stopped, with no error and "
        "no token lost or sent twice; past it they fail with an error event (0: at once).",
        roles=(A,), ge=0)
    heartbeat_interval_s: float = setting(1.0, "Heartbeat period between steps.", roles=(A, F), gt=0)
    ffn_batch_window_s: float = setting(0.0, "FFN: wait up to this long for every peer's plan so their rows share one "
                                        "step.", roles=(F,), ge=0)

    def ffn_host(self, endpoint: int) -> str:
        """Host name of FFN process `endpoint` (`GroupSettings.ffn_endpoint`; the rank itself without expert
        parallelism)."""
        return self.ffn_address_template.format(rank=endpoint)

    def ffn_ports(self, endpoint: int) -> tuple[int, int]:
        """(control, data) ports of FFN process `endpoint`; a stride keeps local processes apart."""
        offset = endpoint * self.port_stride
        return self.control_port + offset, self.data_port + offset


@dataclass(frozen=True)
class SplitSettings:
    """How a step is split between attention and the FFN: micro-batches (`afd.stages.StagePolicy`), the router."""

    stages: StageCount = setting(1, "Micro-batches per layer: 1, or 2 for dual-batch overlap (attention computes one "
                                 "while the FFN runs the other).", roles=(A, F))
    gate_on_attention: bool = setting(False, "`true`: the MoE router runs on attention and ships router logits; dense "
                                      "layers stay on attention.")
    dbo_min_tokens: int = setting(0, "With 2 stages, steps of fewer tokens run as one micro-batch (the FFN then reads "
                                  "its weights once).", roles=(A,), ge=0)


@dataclass(frozen=True)
class LoadSettings:
    """What the process loads and runs it on: the checkpoint, its dtype and device, the attention engine."""

    model: str = setting("", "Checkpoint folder (a Hugging Face DeepSeek-V2, DeepSeek-V3/Kimi-K2, DeepSeek-V3.2, Qwen3-MoE or "
                         "GLM-4.x layout; FP8 block-quantized too).")
    dtype: Dtype = setting("auto", "`auto` (bfloat16 on CUDA, float32 on CPU), `float32`, `bfloat16` or `float16`.")
    device: Device = setting("auto", "`auto`, `cpu` or `cuda`.")
    attention_engine: AttentionEngine = setting("afd", "`afd` (our engine) or `vllm` (vLLM's OpenAI server with "
                                                "`afd.vllm_plugin`).", roles=(A,))
    vllm_args: str = setting("", "Extra arguments for vLLM's server when `attention_engine` is `vllm`, shell-quoted.",
                             roles=(A,))


@dataclass(frozen=True)
class SchedulerSettings:
    """What one engine step may hold and how long a sequence may grow."""

    max_num_seqs: int = setting(64, "Most sequences in one engine step; also the largest decode graph.",
                                gt=0)
    max_model_len: int = setting(0, "Longest prompt + output in tokens (0: the model's `max_position_embeddings`).",
                                 roles=(A, M), ge=0)
    max_num_batched_tokens: int = setting(8192, "Most tokens (prefill + decode) in one engine step.",
                                          gt=0)
    prefill_itl_ratio: float = setting(  # 0: off, the default (issue 33)
        0.0, "While requests decode, a step takes only as many prompt tokens as keep its predicted time within this "
        "multiple of a decode-only step's (both learned from the rank's own steps), so arriving prompts do not stretch "
        "the running streams' inter-token latency; but at least 32, and enough that every prompt is in within "
        "`prefill_backlog_steps` steps of being queued (below 1: only those floors). No cap where no chunk is known "
        "to fit the ratio while as many requests wait for their first token as decode (a burst beside a few short "
        "decode steps). 0: off (prompts take all of `max_num_batched_tokens`). Exported as `afd_prefill_cap_tokens`.",
        roles=(A, M), ge=0)
    prefill_backlog_steps: int = setting(
        64, "With `prefill_itl_ratio`: every waiting prompt is prefilled within N steps of being queued (a step beside "
        "decodes takes at least what the most pressed deadline needs). Larger N: steadier inter-token latency during "
        "bursts, later first tokens.", roles=(A, M), gt=0)

    def max_model_len_of(self, spec) -> int:
        """The longest sequence served with the model of `spec`: `max_model_len` where set, never past its positions."""
        return min(self.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)


@dataclass(frozen=True)
class KVCacheSettings:
    """The KV cache's budget, its element type, and whether it keeps prompts' prefixes."""

    kv_cache_bytes: int = setting(
        0, "KV-cache budget of an attention rank in bytes (0: sized from the device, see `gpu_memory_utilization`; "
        "1 GiB on CPU). Capacity in tokens is logged at start and exported as `afd_kv_cache_capacity_tokens`.",
        roles=(A, M), ge=0)
    gpu_memory_utilization: float = setting(
        0.9, "With `kv_cache_bytes` 0 on a GPU: the KV cache takes this fraction of the GPU's memory, less what is in "
        "use after loading the weights, the peak of the largest step (`max_num_batched_tokens`, profiled at start) "
        "and 1 GiB for the decode graphs (vLLM's `--gpu-memory-utilization`).", roles=(A, M), gt=0, le=1)
    kv_cache_dtype: KVCacheDtype = setting(
        "auto", "Element type of the KV cache (vLLM's `--kv-cache-dtype`): `auto` = the model's dtype; `fp8` = "
        "float8 e4m3 with a static per-tensor scale of 1.0 (MLA's latent and rotary key, GQA's keys and values), "
        "half the bytes a token, so about twice the tokens in the same memory.", roles=(A, M))
    prefix_caching: bool = setting(
        True, "Automatic prefix caching: a prompt's full KV-cache blocks stay cached after its request ends (evicted "
        "least recently used when the cache needs room), and a later prompt with the same prefix (and `cache_salt`) "
        "starts its prefill after them; `usage.prompt_tokens_details.cached_tokens` and "
        "`afd_prefix_cache_hits_total` count them. false: every prompt is prefilled in full.", roles=(A, M))


@dataclass(frozen=True)
class ApiSettings:
    """The OpenAI-compatible API: address, model name, limits, failover and its processes."""

    http_host: str = setting("0.0.0.0", "Address of the OpenAI-compatible API (attention ranks).", 
                             roles=(A, M))
    http_port: int = setting(8000, "Port of the OpenAI-compatible API (attention ranks).", roles=(A, M),
                             ge=1, le=65535)
    served_model_name: str = setting("", "Model id the API answers to (default: the checkpoint folder's name).",
                                     roles=(A, M))
    failover_url: str = setting(
        "", "Attention: base URL (the client Service) where a request this rank answers with 503 before its first "
        "token is sent on, e.g. while its FFN is lost; empty: no failover. The operator sets it.",
        roles=(A,))
    max_request_bytes: int = setting(16 << 20, "Largest API request body; larger ones get 413 (refused from "
                                     "Content-Length or as it arrives).", roles=(A, M), gt=0)
    max_prompts: int = setting(128, "Most prompts in one `/v1/completions` request; more get 400.", 
                               roles=(A, M), gt=0)
    max_prompt_chars: int = setting(0, "Most characters of one prompt (or of all chat messages) before tokenization "
                                    "(0: 32 per context token).", roles=(A, M), ge=0)
    reasoning_parser: str = setting(
        "", "Chat completions: split the model's thinking from its answer into `message.reasoning` (streamed as "
        "`delta.reasoning`), as vLLM's `--reasoning-parser`: `deepseek_r1`, `qwen3`, `deepseek_v3` (V3.1's "
        "thinking mode, `chat_template_kwargs: {\"thinking\": true}`) or `kimi_k2` (Kimi-K2-Thinking). Empty: the thinking stays in `content`.",
        roles=(A, M), check=_reasoning_parser)
    tool_call_parser: str = setting(
        "", "Chat completions with `tools` and `tool_choice: auto`: how the calls the model writes in its own markup are "
        "read into `message.tool_calls`, as vLLM's `--tool-call-parser`: `deepseek_v3` (DeepSeek-V3, R1), "
        "`deepseek_v31` (V3.1, R1-0528), `kimi_k2` or `qwen3` (the Hermes `<tool_call>` JSON form). Empty: by the "
        "checkpoint's architecture (DeepSeek-V3's by its chat template's markup); `none`: not read (the markup stays "
        "in `content`). Named and `required` tool choices are constrained by a grammar whatever this says.",
        roles=(A, M), check=_tool_call_parser)
    reasoning_content: bool = setting(False, "With `reasoning_parser`: the thinking also as `reasoning_content`, the "
                                      "field older clients read.", roles=(A, M))
    api_key: str = setting(
        "", "Keys a client must send as `Authorization: Bearer <key>` on every `/v1` route and `/tokenize`, "
        "`/detokenize` (401 otherwise); several separated by commas, any one accepted (vLLM's `--api-key`). `/health`, "
        "`/live` and `/metrics` stay open. Empty: no key asked. Never logged; prefer the variable to the flag (a "
        "command line shows in `ps`).", roles=(A, M), check=_api_keys, secret=True, flag=True)
    api_process: bool = setting(
        False, "`true`: the OpenAI API (uvicorn, tokenization, SSE) runs in a child process and talks to the engine "
        "core over local zmq sockets, so the HTTP work does not hold the engine's GIL; probes and `/metrics` stay on "
        "`metrics_port` in the core. `false`: one process.", roles=(A, M))
    api_servers: int = setting(
        1, "How many API processes share the HTTP port (SO_REUSEPORT: the kernel spreads connections over them), each "
        "its own event loop and core of CPU, like vLLM's `--api-server-count`; more than 1 implies `api_process`.",
        roles=(A, M), ge=1, le=MAX_API_SERVERS)

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys of `api_key`, one per comma (empty: the API asks for none)."""
        return tuple(key.strip() for key in self.api_key.split(",") if key.strip())

    @property
    def api_children(self) -> int:
        """How many API processes this rank starts (0: the API runs in the engine's process)."""
        return self.api_servers if self.api_process or self.api_servers > 1 else 0


@dataclass(frozen=True)
class GraphSettings:
    """CUDA graphs and the start-up step ceiling."""

    cuda_graphs: bool = setting(False, "`true`: decode graphs on attention and a step-graph cache on the FFN (CUDA "
                                "with the nccl connector).")
    mixed_graph_tokens: int = setting(
        2048, "With `cuda_graphs` (monolithic and attention ranks): steps that carry prompt tokens, up to this many "
        "tokens (and `max_num_batched_tokens`), replay piecewise graphs: everything between two attention kernels "
        "captured per padded token bucket, attention eager; an attention rank's FFN rank replays its whole-step graph "
        "for the bucket. About 0.5 MiB of graph pool per token at DeepSeek-V2-Lite shapes, kept out of the KV cache. "
        "`0`: such steps run eagerly.", roles=(A, M), ge=0)
    ceiling_batches: str = setting(
        "", "Comma-separated batch sizes whose graph-replayed decode step is timed at start (log and "
        "`afd_step_ceiling_seconds`; the serving benchmark's ceiling). Empty: off.", roles=(A, M),
        check=_positive_ints)
    ceiling_context: int = setting(704, "Cached tokens of every sequence in the start-up ceiling's timed steps "
                                   "(`ceiling_batches`); the serving benchmark sets its load's mean context.",
                                   roles=(A, M), gt=0)

    def piecewise_tokens(self, step_tokens: int) -> int:
        """The largest prompt step that replays piecewise graphs (0: none) when a step holds at most `step_tokens`
        tokens (`max_num_batched_tokens`): `mixed_graph_tokens`, at most that, and only with `cuda_graphs`."""
        return min(self.mixed_graph_tokens, step_tokens) if self.cuda_graphs else 0


@dataclass(frozen=True)
class ProcessSettings:
    """The process around the role: probes and metrics, per-layer timings, shutdown."""

    metrics_port: int = setting(9090, "Port of `/metrics`, `/health` (readiness), `/live` and `/drain` (preStop) "
                                "(both roles; the probes use it).", ge=1, le=65535)
    shutdown_grace_s: float = setting(30.0, "On SIGTERM, how long in-flight requests may finish before they are "
                                      "failed.", roles=(A, M), gt=0)
    profile_every: int = setting(16, "Per-layer timings on every N-th step (0: off).", ge=0)

