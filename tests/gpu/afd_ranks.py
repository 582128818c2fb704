"""The attention side of the GPU parity tests' AFD runs: one `afd run-batch` process per attention rank, each
over its block of PROMPTS, beside the FFN processes a test has started; their greedy tokens in PROMPTS' order."""

import json
import signal
import time

from afd.config import config_to_env
from afd.local.offline_batch import split_prompts
from tests.conftest import PROMPTS
from tests.gpu.nccl_env import gpu_env


def attention_tokens(processes, config, watch: list[str], max_tokens: int,
                     attention_env=lambda name: gpu_env(name, 0)) -> list:
    """Greedy tokens (`max_tokens` each, EOS ignored) of PROMPTS from `config`'s attention ranks, started in
    `processes` (a `LocalProcesses`) with `attention_env(name)` added to their environment, while the processes
    named in `watch` (the FFN side) keep running. On a failure or a timeout every process writes its threads'
    stacks into its log (afd.cli's faulthandler) and the logs' tails are printed."""
    blocks = split_prompts(len(PROMPTS), config.group.num_attention_ranks)
    names = []
    for rank, block in enumerate(blocks):
        job = processes.workdir / f"a{rank}.json"
        job.write_text(json.dumps({"prompts": [PROMPTS[i] for i in block], "max_tokens": max_tokens,
                                   "ignore_eos": True}))
        name = f"attn-{rank}"
        env = {**config_to_env(config.replace(role="attention", rank=rank)), **attention_env(name)}
        processes.start(name, ["run-batch", "--input", str(job), "--output", str(processes.workdir / f"a{rank}.out")],
                        env)
        names.append(name)
    try:
        processes.wait(names, watch=watch, timeout_s=600)
    except BaseException:  # pytest-timeout's failure is a BaseException
        for name in [*watch, *names]:
            if processes.children[name].poll() is None:
                processes.children[name].send_signal(signal.SIGUSR1)
        time.sleep(2)
        for name in [*watch, *names]:  # the NCCL warnings are in the children's logs
            print(f"--- {name} ---\n" + processes.log_path(name).read_text(errors="replace")[-6000:])
        raise
    tokens = [None] * len(PROMPTS)
    for rank, block in enumerate(blocks):
        output = json.loads((processes.workdir / f"a{rank}.out").read_text())
        for position, index in enumerate(block):
            tokens[index] = output["tokens"][position]
    return tokens
