"""Expert parallelism on GPUs: an FFN rank of 2 shards over NCCL with CUDA graphs equals the bf16 monolith.

Attention runs on GPU 0. NCCL refuses a pair whose two ranks share a GPU, so no shard can sit on
GPU 0 with attention: with 3+ GPUs the shards get GPUs 1 and 2, with 2 GPUs both share GPU 1
(each shard is its own process and pair). `AFD_TEST_EP_GPUS=1,2` overrides the placement.
"""

import json
import os
import signal
import time

import pytest
import torch

from tests.conftest import PROMPTS
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
    from afd.local.offline_batch import split_prompts

    base = AFDConfig(
        num_attention_ranks=int(topology[0]), num_ffn_ranks=1, stages=stages, model=str(path), dtype="bfloat16",
        device="cuda", cuda_graphs=graphs, max_num_seqs=8, gate_on_attention=gate == "attention",
        ffn_expert_parallel=shards, port_stride=2, peer_timeout_s=60.0,
        ffn_batch_window_s=0.002 if topology == "2A1F" else 0.0,
    )
    config = local_zmq_config(base).replace(connector="nccl")
    blocks = split_prompts(len(PROMPTS), config.num_attention_ranks)
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
        names = []
        for rank, block in enumerate(blocks):
            job = processes.workdir / f"a{rank}.json"
            job.write_text(json.dumps({"prompts": [PROMPTS[i] for i in block], "max_tokens": GPU_TOKENS, "ignore_eos": True}))
            env = {**config_to_env(config.replace(role="attention", rank=rank)), "CUDA_VISIBLE_DEVICES": "0"}
            processes.start(f"attn-{rank}", ["run-batch", "--input", str(job), "--output", str(processes.workdir / f"a{rank}.out")], env)
            names.append(f"attn-{rank}")
        try:
            processes.wait(names, watch=ffn_names, timeout_s=600)
        except BaseException:  # pytest-timeout's failure is a BaseException
            for name in [*ffn_names, *names]:  # every thread's stack into the child's log (afd.cli's faulthandler)
                if processes.children[name].poll() is None:
                    processes.children[name].send_signal(signal.SIGUSR1)
            time.sleep(2)
            for name in [*ffn_names, *names]:
                print(f"--- {name} ---\n" + processes.log_path(name).read_text(errors="replace")[-6000:])
            raise
        outputs = [json.loads((processes.workdir / f"a{rank}.out").read_text()) for rank in range(len(blocks))]
    tokens = [None] * len(PROMPTS)
    for block, output in zip(blocks, outputs):
        for position, index in enumerate(block):
            tokens[index] = output["tokens"][position]
    return tokens


@pytest.mark.parametrize("topology, stages, gate", [("1A1F", 1, "ffn"), ("1A1F", 2, "attention"), ("2A1F", 2, "ffn")])
def test_bf16_expert_parallel_over_nccl_with_graphs_equals_bf16_monolithic(topology, stages, gate, checkpoints):
    reference, _ = monolithic(checkpoints["deepseek_v2"], torch.bfloat16, graphs=True)
    assert afd_nccl_sharded(checkpoints["deepseek_v2"], topology, 2, stages, True, gate) == reference.tokens
