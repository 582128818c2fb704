"""A reduced DeepSeek-V3-shaped model (the real MoE shapes: 256 routed + 1 shared experts at hidden 7168, width
2048, top-8 by noaux_tc; two layers) in bf16 and in FP8: the monolith's 32 greedy tokens equal AFD's over NCCL.
Needs CUDA and NCCL pairs (two GPUs, or AFD_GPU_SHARE_ONE=1 on one); about 35 GB of checkpoints under /tmp."""

import pytest
import torch

from tests.gpu.nccl_env import nccl_pairs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def v3_checkpoints(tmp_path_factory):
    from tests.gpu.v3_checkpoint import write_v3_shaped

    root = tmp_path_factory.mktemp("v3_shaped")
    bf16, fp8 = write_v3_shaped(root / "bf16", root / "fp8")
    return {"bf16": bf16, "fp8": fp8}


@nccl_pairs
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_v3_shaped_monolith_equals_afd_over_nccl(weights, v3_checkpoints):
    from tests.gpu.test_gpu_path import afd_nccl, monolithic

    reference, runner = monolithic(v3_checkpoints[weights], torch.bfloat16)
    if weights == "fp8":  # the weights stayed FP8 on the GPU: experts and dense projections
        experts = next(m for m in runner.model.modules() if type(m).__name__ == "Experts")
        assert experts.gate_up.dtype == torch.float8_e4m3fn and experts.gate_up_scale is not None
        assert any(type(m).__name__ == "Fp8Linear" for m in runner.model.modules())
    del runner
    torch.cuda.empty_cache()
    assert afd_nccl(v3_checkpoints[weights], "1A1F", 1, False) == reference.tokens
