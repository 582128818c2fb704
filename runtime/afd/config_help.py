"""One line of help per `AFDConfig` setting: the source of docs/configuration.md (torch-free)."""

from __future__ import annotations

SETTING_HELP: dict[str, str] = {
    "role": "`attention`, `ffn`, or `monolithic` (one process, the FFN local, same engine and API: the A/B baseline).",
    "rank": "Rank within the role. Unset in a pod: the StatefulSet ordinal at the end of `$HOSTNAME`.",
    "num_attention_ranks": "Attention ranks in the group (A of xAyF).",
    "num_ffn_ranks": "FFN ranks in the group (F of xAyF); attention rank a maps to FFN rank a // (A/F).",
    "ffn_expert_parallel": "Shards per FFN rank (G): shard s holds routed experts [s·E/G, (s+1)·E/G) and 1/G of the "
                           "shared-expert columns (dense layers: shard 0); attention sums the G partial outputs "
                           "(docs/expert-parallel.md).",
    "ffn_shard": "FFN role: this process's shard of its rank. Unset in a pod with G > 1: the ordinal is rank·G + shard.",
    "ffn_address_template": "Host of FFN process `{rank}` (its pod ordinal: rank·G + shard with expert parallelism), "
                            "e.g. `demo-g0-ffn-{rank}.demo-g0-ffn.ns.svc`.",
    "control_port": "FFN control-plane port (zmq: Hello, StepPlan, Heartbeat, Goodbye).",
    "data_port": "FFN data-plane port (zmq frames; with nccl, only the NCCL bootstrap).",
    "port_stride": "Added to both ports per FFN rank, so several FFN ranks can share one host (local runs).",
    "bind_host": "Address the FFN rank listens on.",
    "max_message_bytes": "Largest control or data message accepted; larger ones are refused and counted.",
    "connector": "`zmq` (any network, CPU or GPU), `nccl` (GPU data plane, zmq control plane) or `loopback` (tests).",
    "stages": "Micro-batches per layer: 1, or 2 for dual-batch overlap (attention computes one while the FFN runs the other).",
    "gate_on_attention": "`true`: the MoE router runs on attention and ships router logits; dense layers stay on attention.",
    "model": "Checkpoint folder (a Hugging Face DeepSeek-V2, DeepSeek-V3/Kimi-K2 or Qwen3-MoE layout; FP8 block-quantized too).",
    "dtype": "`auto` (bfloat16 on CUDA, float32 on CPU), `float32`, `bfloat16` or `float16`.",
    "device": "`auto`, `cpu` or `cuda`.",
    "http_host": "Address of the OpenAI-compatible API (attention ranks).",
    "http_port": "Port of the OpenAI-compatible API (attention ranks).",
    "metrics_port": "Port of `/metrics`, `/health` (readiness), `/live` and `/drain` (preStop) (both roles; the probes use it).",
    "max_num_seqs": "Most sequences in one engine step; also the largest decode graph.",
    "max_model_len": "Longest prompt + output in tokens (0: the model's `max_position_embeddings`).",
    "max_num_batched_tokens": "Most tokens (prefill + decode) in one engine step.",
    "prefill_itl_ratio": ("While requests decode, a step takes only as many prompt tokens as keep its predicted time "
                          "within this multiple of a decode-only step's (both learned from the rank's own steps), "
                          "so arriving prompts do not stretch the running streams' inter-token latency; but at least 32, "
                          "and enough that every prompt is in within `prefill_backlog_steps` steps of being queued "
                          "(below 1: only those floors). No cap where no chunk is known to fit the ratio while as many "
                          "requests wait for their first token as decode (a burst beside a few short decode steps). "
                          "0: off (prompts take all of `max_num_batched_tokens`). Exported as `afd_prefill_cap_tokens`."),
    "prefill_backlog_steps": ("With `prefill_itl_ratio`: every waiting prompt is prefilled within N steps of being "
                              "queued (a step beside decodes takes at least what the most pressed deadline needs). "
                              "Larger N: steadier inter-token latency during bursts, later first tokens."),
    "kv_cache_bytes": "KV-cache budget of an attention rank in bytes (0: sized from the device, see `gpu_memory_utilization`; 1 GiB on CPU). Capacity in tokens is logged at start and exported as `afd_kv_cache_capacity_tokens`.",
    "served_model_name": "Model id the API answers to (default: the checkpoint folder's name).",
    "failover_url": ("Attention: base URL (the client Service) where a request this rank answers with 503 before "
                     "its first token is sent on, e.g. while its FFN is lost; empty: no failover. The operator sets it."),
    "group_token": "Identifies the AFD group; a peer of another group is refused at the handshake.",
    "group_secret": "Shared secret of the group (from the operator's Secret); proves a peer in the handshake, never sent or logged.",
    "connect_timeout_s": "How long an attention rank waits for its FFN rank at start-up and on reconnect.",
    "peer_timeout_s": "A peer silent this long is lost (an FFN rank's requests are then held for `ffn_hold_s`).",
    "ffn_hold_s": ("Attention: when the FFN rank is lost, its requests are held (KV cache intact) this many seconds "
                   "for it (its restarted pod, at the same address) to come back, and go on from where they stopped, with no error and no "
                   "token lost or sent twice; past it they fail with an error event (0: at once)."),
    "heartbeat_interval_s": "Heartbeat period between steps.",
    "shutdown_grace_s": "On SIGTERM, how long in-flight requests may finish before they are failed.",
    "profile_every": "Per-layer timings on every N-th step (0: off).",
    "cuda_graphs": "`true`: decode graphs on attention and a step-graph cache on the FFN (CUDA with the nccl connector).",
    "mixed_graph_tokens": "With `cuda_graphs` (monolithic and attention ranks): steps that carry prompt tokens, up to this many tokens (and `max_num_batched_tokens`), replay piecewise graphs: everything between two attention kernels captured per padded token bucket, attention eager; an attention rank's FFN rank replays its whole-step graph for the bucket. About 0.5 MiB of graph pool per token at DeepSeek-V2-Lite shapes, kept out of the KV cache. `0`: such steps run eagerly.",
    "ffn_batch_window_s": "FFN: wait up to this long for every peer's plan so their rows share one step.",
    "dbo_min_tokens": "With 2 stages, steps of fewer tokens run as one micro-batch (the FFN then reads its weights once).",
    "attention_engine": "`afd` (our engine) or `vllm` (vLLM's OpenAI server with `afd.vllm_plugin`).",
    "vllm_args": "Extra arguments for vLLM's server when `attention_engine` is `vllm`, shell-quoted.",
    "max_request_bytes": "Largest API request body; larger ones get 413 (refused from Content-Length or as it arrives).",
    "max_prompts": "Most prompts in one `/v1/completions` request; more get 400.",
    "max_prompt_chars": "Most characters of one prompt (or of all chat messages) before tokenization (0: 32 per context token).",
    "gpu_memory_utilization": "With `kv_cache_bytes` 0 on a GPU: the KV cache takes this fraction of the GPU's memory, less what is in use after loading the weights, the peak of the largest step (`max_num_batched_tokens`, profiled at start) and 1 GiB for the decode graphs (vLLM's `--gpu-memory-utilization`).",
    "ceiling_context": "Cached tokens of every sequence in the start-up ceiling's timed steps (`ceiling_batches`); the serving benchmark sets its load's mean context.",
    "ceiling_batches": "Comma-separated batch sizes whose graph-replayed decode step is timed at start (log and `afd_step_ceiling_seconds`; the serving benchmark's ceiling). Empty: off.",
    "api_process": ("`true`: the OpenAI API (uvicorn, tokenization, SSE) runs in a child process and talks to the engine "
                    "core over local zmq sockets, so the HTTP work does not hold the engine's GIL; probes and `/metrics` "
                    "stay on `metrics_port` in the core. `false`: one process."),
    "api_servers": ("How many API processes share the HTTP port (SO_REUSEPORT: the kernel spreads connections over "
                    "them), each its own event loop and core of CPU, like vLLM's `--api-server-count`; more than 1 "
                    "implies `api_process`."),
}
