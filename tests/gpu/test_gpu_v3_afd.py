"""A reduced DeepSeek-V3-shaped model (the real MoE shapes: 256 routed + 1 shared experts at hidden 7168, width
2048, top-8 by noaux_tc; two layers) in bf16 and in FP8: the monolith's 32 greedy tokens equal AFD's over NCCL —
1A1F at stage 1 without graphs (the monolith's row counts), and in batch-invariant mode (AFD_BATCH_INVARIANT=1) 2A1F
at two stages with CUDA graphs and an FFN rank of two expert-parallel shards with the gate on the attention side
(topologies that split the monolith's rows, see the test). Needs CUDA
and NCCL pairs (two GPUs, or AFD_GPU_SHARE_ONE=1 on one, where every rank and shard shares GPU 0); about 35 GB of
checkpoints under /tmp (AFD_V3_FORMATS=fp8: 13 GB, the bf16 cases skip)."""

import os

import pytest
import torch

from tests.gpu.afd_ranks import attention_tokens
from tests.gpu.nccl_env import gpu_env, nccl_pairs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


FORMATS = os.environ.get("AFD_V3_FORMATS", "bf16,fp8").split(",")  # the checkpoints written; others' tests skip


@pytest.fixture(scope="module")
def v3_checkpoints(tmp_path_factory):
    from tests.gpu.v3_checkpoint import write_v3_shaped

    root = tmp_path_factory.mktemp("v3_shaped")
    bf16, fp8 = write_v3_shaped(*(root / name if name in FORMATS else None for name in ("bf16", "fp8")))
    return {"bf16": bf16, "fp8": fp8}


@pytest.fixture(scope="module")
def v3_monolith(v3_checkpoints):
    """The monolith's tokens per weight format (and batch-invariant mode or not), computed once per module (its
    model freed after)."""
    from afd.kernels import batch_invariant
    from tests.gpu.test_gpu_path import monolithic

    tokens = {}

    def reference(weights: str, invariant: bool = False) -> list:
        if v3_checkpoints[weights] is None:
            pytest.skip(f"AFD_V3_FORMATS={','.join(FORMATS)}: no {weights} checkpoint written")
        if (weights, invariant) not in tokens:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("AFD_BATCH_INVARIANT", "1" if invariant else "0")
                result, runner = monolithic(v3_checkpoints[weights], torch.bfloat16)
            batch_invariant.uninstall()  # the loader installed it for this process
            if weights == "fp8":  # the weights stayed FP8 on the GPU: experts and dense projections
                experts = next(m for m in runner.model.modules() if type(m).__name__ == "Experts")
                assert experts.gate_up.dtype == torch.float8_e4m3fn and experts.gate_up_scale is not None
                assert any(type(m).__name__ == "Fp8Linear" for m in runner.model.modules())
            tokens[weights, invariant] = result.tokens
            del runner
            torch.cuda.empty_cache()
        return tokens[weights, invariant]

    return reference


def afd_v3(path, topology: str, stages: int, graphs: bool, gate: str = "ffn", shards: int = 1,
           invariant: bool = False) -> list:
    """Greedy tokens of PROMPTS from real processes over NCCL: attention ranks on GPU 0, the FFN rank's `shards`
    expert-parallel processes on GPU 1 (all on GPU 0 under AFD_GPU_SHARE_ONE: `tests.gpu.nccl_env`); every process
    in batch-invariant mode if `invariant`."""
    from afd.config import AFDConfig, config_to_env
    from afd.local.children import LocalProcesses, free_port_block
    from afd.local.group_processes import local_zmq_config
    from tests.gpu.test_gpu_path import GPU_TOKENS

    base = AFDConfig(
        num_attention_ranks=int(topology[0]), num_ffn_ranks=1, stages=stages, model=str(path), dtype="bfloat16",
        device="cuda", cuda_graphs=graphs, max_num_seqs=8, gate_on_attention=gate == "attention",
        ffn_batch_window_s=0.002 if topology == "2A1F" else 0.0, peer_timeout_s=60.0,
        **({"ffn_expert_parallel": shards, "port_stride": 2} if shards > 1 else {}),
    )
    config = local_zmq_config(base).replace(connector="nccl")
    metrics_ports = free_port_block(shards)
    mode = {"AFD_BATCH_INVARIANT": "1" if invariant else "0"}
    with LocalProcesses() as processes:
        ffn_names = []
        for shard in range(shards):
            name = f"ffn-0-shard-{shard}" if shards > 1 else "ffn-0"
            role = config.replace(role="ffn", **({"ffn_shard": shard, "metrics_port": metrics_ports + shard}
                                                 if shards > 1 else {}))
            processes.start(name, ["serve"], {**config_to_env(role), **gpu_env(name, 1), **mode})
            ffn_names.append(name)
        return attention_tokens(processes, config, ffn_names, GPU_TOKENS, lambda name: {**gpu_env(name, 0), **mode})


@nccl_pairs
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_v3_shaped_monolith_equals_afd_over_nccl(weights, v3_checkpoints, v3_monolith):
    reference = v3_monolith(weights)  # first: the monolith's model is freed before the ranks start
    assert afd_v3(v3_checkpoints[weights], "1A1F", 1, False) == reference


@nccl_pairs
@pytest.mark.parametrize("weights, topology, stages, gate, shards", [
    ("fp8", "2A1F", 2, "ffn", 1), ("bf16", "2A1F", 2, "ffn", 1), ("fp8", "1A1F", 2, "attention", 2),
    ("bf16", "1A1F", 2, "attention", 2)],
    ids=["fp8-2A1F-stages2", "bf16-2A1F-stages2", "fp8-1A1F-stages2-gate_attention-ep2",
         "bf16-1A1F-stages2-gate_attention-ep2"])
def test_v3_shaped_monolith_equals_afd_with_graphs_in_batch_invariant_mode(weights, topology, stages, gate, shards,
                                                                          v3_checkpoints, v3_monolith):
    """With CUDA graphs (decode steps and piecewise prompt graphs): 2A1F at two stages, and an FFN rank of two
    expert-parallel shards (each 128 routed experts and half the shared expert's columns) with the gate on the
    attention side, every process with AFD_BATCH_INVARIANT=1. Each topology splits the monolith's rows (two attention
    ranks with their own prompts, or two micro-batches), and in the default mode cuBLAS rounds a token's dense
    projections by the row count of its GEMM (bf16 and FP8 block-scaled alike): on an H100 greedy tokens parted from
    the monolith's in the default mode for bf16 2A1F (at the third token, session 46) and for both FP8 cases (session
    48), where on an H200 the FP8 ones had matched (session 42). Batch-invariant mode (`afd.kernels.batch_invariant`)
    rounds a token alike whatever its step's row count, so equality holds by design."""
    reference = v3_monolith(weights, invariant=True)
    assert afd_v3(v3_checkpoints[weights], topology, stages, True, gate, shards, invariant=True) == reference
