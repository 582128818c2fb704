"""Expert parallelism on GPUs: an FFN rank of 2 shards over NCCL with CUDA graphs equals the bf16 monolith.

Attention runs on GPU 0. NCCL refuses a pair whose two ranks share a GPU, so no shard can sit on
GPU 0 with attention: with 3+ GPUs the shards get GPUs 1 and 2, with 2 GPUs both share GPU 1
(each shard is its own process and pair). `AFD_TEST_EP_GPUS=1,2` overrides the placement.
"""

import os

import pytest
import torch

from tests.gpu.afd_ranks import attention_tokens
from tests.gpu.test_gpu_path import GPU_TOKENS, monolithic

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                 reason="NCCL pairs need two GPUs")]


def shard_gpus(shards: int) -> list[str]:
    if os.environ.get("AFD_TEST_EP_GPUS"):
        return os.environ["AFD_TEST_EP_GPUS"].split(",")
    return [str(1 + s) if torch.cuda.device_count() > shards else "1" for s in range(shards)]


def afd_nccl_sharded(path, topology: str, shards: int, stages: int, graphs: bool, gate: str = "ffn"):
    """Greedy tokens of PROMPTS from real processes: FFN shards per `shard_gpus`, attention on GPU 0."""
    from afd.config import AFDConfig, config_to_env
    from afd.local.children import LocalProcesses, free_port_block
    from afd.local.group_processes import local_zmq_config

    base = AFDConfig(
        num_attention_ranks=int(topology[0]), num_ffn_ranks=1, stages=stages, model=str(path), dtype="bfloat16",
        device="cuda", cuda_graphs=graphs, max_num_seqs=8, gate_on_attention=gate == "attention",
        ffn_expert_parallel=shards, port_stride=2, peer_timeout_s=60.0,
        ffn_batch_window_s=0.002 if topology == "2A1F" else 0.0,
    )
    config = local_zmq_config(base).replace(connector="nccl")
    gpus = shard_gpus(shards)
    metrics_ports = free_port_block(shards)
    with LocalProcesses() as processes:
        ffn_names = []
        for shard in range(shards):
            name = f"ffn-0-shard-{shard}"
            env = {**config_to_env(config.replace(role="ffn", ffn_shard=shard, metrics_port=metrics_ports + shard)),
                   "CUDA_VISIBLE_DEVICES": gpus[shard]}
            processes.start(name, ["serve"], env)
            ffn_names.append(name)
        return attention_tokens(processes, config, ffn_names, GPU_TOKENS, lambda name: {"CUDA_VISIBLE_DEVICES": "0"})


@pytest.mark.parametrize("topology, stages, gate", [("1A1F", 1, "ffn"), ("1A1F", 2, "attention"), ("2A1F", 2, "ffn")])
def test_bf16_expert_parallel_over_nccl_with_graphs_equals_bf16_monolithic(topology, stages, gate, checkpoints):
    reference, _ = monolithic(checkpoints["deepseek_v2"], torch.bfloat16, graphs=True)
    assert afd_nccl_sharded(checkpoints["deepseek_v2"], topology, 2, stages, True, gate) == reference.tokens
