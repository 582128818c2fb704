"""Where the ranks of a GPU test's NCCL pairs run.

By default FFN ranks take GPU 1 and attention ranks GPU 0 (P2P between them). With
AFD_GPU_SHARE_ONE=1 every rank runs on GPU 0 and NCCL is told each process is its own host
(NCCL_HOSTID), so the pairs use its socket transport on loopback: for a machine with one GPU
(NCCL refuses two ranks of a communicator on one device otherwise).
"""

import os

import pytest
import torch

SHARE_ONE = os.environ.get("AFD_GPU_SHARE_ONE") == "1"
nccl_pairs = pytest.mark.skipif(torch.cuda.device_count() < (1 if SHARE_ONE else 2),
                                reason="NCCL pairs need two CUDA GPUs (or AFD_GPU_SHARE_ONE=1 on one)")


def gpu_env(name: str, gpu: int) -> dict[str, str]:
    """The environment that puts process `name` on `gpu` (GPU 0 for every process when sharing one)."""
    if SHARE_ONE:
        return {"CUDA_VISIBLE_DEVICES": "0", "NCCL_HOSTID": f"afd-test-{name}", "NCCL_SOCKET_IFNAME": "lo"}
    return {"CUDA_VISIBLE_DEVICES": str(gpu)}
