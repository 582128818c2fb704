"""What `afd_decode.py`'s ranks share: its phases, a child's set-up, a rank's settings for a phase, and the rows
a step splits into (children import torch only after `child_setup`)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASES = {  # name: (attention ranks, stages, FFN batch window s, DBO from this many tokens)
    "A": (1, 2, 0.0, 0),
    "B": (1, 1, 0.0, 0),
    "C": (2, 2, 0.05, 0),
    "D": (1, 2, 0.0, 192),  # AFD_DBO_MIN_TOKENS=192: one micro-batch below 192 tokens, DBO from there
}


def child_setup(gpu: int, deadline: float) -> None:
    """A rank's process: its GPU, a stack dump and exit at the deadline, this checkout's `bench` and `afd`."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    import faulthandler

    faulthandler.dump_traceback_later(max(5.0, deadline - time.time()), exit=True)
    sys.path[:0] = [str(REPO), str(REPO / "runtime")]


def afd_config(args, phase: str, role: str, rank: int):
    from afd.config import AFDConfig

    ranks, stages, window, dbo_min_tokens = PHASES[phase]
    port = args.ports[phase]
    return AFDConfig(
        role=role, rank=rank, num_attention_ranks=ranks, num_ffn_ranks=1, connector="nccl", stages=stages,
        ffn_address_template="127.0.0.1", bind_host="127.0.0.1", control_port=port, data_port=port + 1,
        dtype="bfloat16", device="cuda", cuda_graphs=True, peer_timeout_s=60.0, connect_timeout_s=120.0,
        ffn_batch_window_s=window, max_num_seqs=max(args.batches), profile_every=0, dbo_min_tokens=dbo_min_tokens,
    )


def split_rows(total: int, stages: int) -> tuple:
    from afd.step.stages import StagePolicy

    return StagePolicy(stages).rows(total)
