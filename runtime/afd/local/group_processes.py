"""A whole AFD group as real processes on 127.0.0.1 over the `zmq` connector.

FFN ranks run `afd serve` (what their pods run); attention ranks run `afd run-batch`
on their block of prompts. Everything started here is stopped before returning.
"""

from __future__ import annotations

import json
import logging
from typing import Sequence

from afd.local.offline_batch import split_prompts
from afd.config import AFDConfig, config_to_env
from afd.local.children import LocalProcesses, free_port_block, threads_per_rank

log = logging.getLogger(__name__)


def local_zmq_config(base: AFDConfig) -> AFDConfig:
    """`base` with every FFN process (rank and shard) on 127.0.0.1 and its own pair of free ports."""
    first_port = free_port_block(2 * base.group.num_ffn_ranks * base.group.ffn_expert_parallel)
    return base.replace(
        connector="zmq",
        ffn_address_template="127.0.0.1",
        bind_host="127.0.0.1",
        control_port=first_port,
        data_port=first_port + 1,
        port_stride=2,
    )


def generate_in_processes(
    base: AFDConfig,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    ignore_eos: bool = False,
    ffn_model: str | None = None,
    timeout_s: float = 900.0,
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy (tokens, last-step logits) of `prompts`, in order, from one process per rank."""
    config = local_zmq_config(base)
    group = config.group
    topology = group.topology
    blocks = split_prompts(len(prompts), topology.num_attention)
    shards = group.ffn_expert_parallel
    metrics_ports = free_port_block(topology.num_ffn * shards)
    threads = threads_per_rank(topology.num_ffn * shards + topology.num_attention)
    with LocalProcesses() as processes:
        ffn_names = []
        for rank in range(topology.num_ffn):
            for shard in range(shards):
                name = f"ffn-{rank}" + (f"-shard-{shard}" if shards > 1 else "")
                ffn_config = config.replace(role="ffn", rank=rank, ffn_shard=shard, model=ffn_model or config.load.model,
                                            http_host="127.0.0.1", metrics_port=metrics_ports + group.ffn_endpoint(rank, shard))
                processes.start(name, ["serve"], {**config_to_env(ffn_config), **threads})
                ffn_names.append(name)
        attention_names = []
        for rank, block in enumerate(blocks):
            name = f"attention-{rank}"
            job = processes.workdir / f"{name}.in.json"
            job.write_text(json.dumps({"prompts": [list(prompts[i]) for i in block], "max_tokens": max_tokens, "ignore_eos": ignore_eos}))
            args = ["run-batch", "--input", str(job), "--output", str(processes.workdir / f"{name}.out.json")]
            processes.start(name, args, {**config_to_env(config.replace(role="attention", rank=rank)), **threads})
            attention_names.append(name)
        log.info("started %d ffn and %d attention processes (logs in %s)", len(ffn_names), len(attention_names), processes.workdir)
        processes.wait(attention_names, watch=ffn_names, timeout_s=timeout_s)
        outputs = [json.loads((processes.workdir / f"{name}.out.json").read_text()) for name in attention_names]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[float]] = [[] for _ in prompts]
    for block, output in zip(blocks, outputs):
        for position, index in enumerate(block):
            tokens[index] = output["tokens"][position]
            logits[index] = output["last_logits"][position]
    return tokens, logits
