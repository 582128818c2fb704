"""No Triton kernel compiles while a GPU rank serves (issue 33's TTFT: a compile mid-serving pauses a step for
0.1-1 s). A fresh process builds a monolithic rank exactly as `afd serve` does (MoE warm-up, profile step, decode
and piecewise graph capture), then serves bursts of prompts of many lengths beside running decodes; every kernel
specialization it meets must have been compiled by warm-up. Skips without CUDA."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[2]

SERVE_BURSTS = """
import json, random, sys, threading
from prometheus_client import CollectorRegistry
from afd.config import AFDConfig
from afd.engine.request import SamplingParams
from afd.kernels.compile_watch import WATCH, kernel_name
from afd.roles.monolithic import build_monolithic
from afd.server.serve.engine_api import build_server

assert WATCH.install()
config = AFDConfig(role="monolithic", model=sys.argv[1], device="cuda", dtype="bfloat16", cuda_graphs=True,
                   max_num_seqs=32, max_num_batched_tokens=1024, kv_cache_bytes=1 << 30)
registry = CollectorRegistry()
role = build_monolithic(config)
_, engine = build_server(config, role, registry)
WATCH.set_serving()
engine.start()
rng, vocab = random.Random(33), role.loaded.spec.vocab_size
done = []
for burst in (1, 3, 16, 7, 32):  # prompts of many lengths, arriving while the last burst decodes
    finished = [threading.Event() for _ in range(burst)]
    for i in range(burst):
        prompt = [rng.randrange(vocab) for _ in range(rng.choice((1, 5, 16, 17, 63, 200, 511, 700)))]
        params = SamplingParams(max_tokens=rng.choice((1, 8, 24)), temperature=rng.choice((0.0, 1.0)), seed=i,
                                ignore_eos=True, logprobs=rng.choice((None, 2)))
        engine.submit(prompt, params, lambda out, e=finished[i]: e.set() if out.finished else None)
    done += finished
for event in done:
    assert event.wait(300), "a request never finished"
engine.stop()
kernels = {kernel_name(d) for d in WATCH.serving_compiles}
print(json.dumps({"warmup": WATCH.warmup_compiles, "serving": WATCH.serving_compiles,
                  "warmed": {k: WATCH.warm_up_specializations(k) for k in kernels}}))
"""


@pytest.mark.parametrize("name", ["deepseek_v2", "qwen3_moe"])
def test_serving_meets_no_kernel_that_warm_up_did_not_compile(name, checkpoints):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", SERVE_BURSTS, str(checkpoints[name])], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["warmup"] > 0  # the hook saw warm-up's compiles: it is live
    assert found["serving"] == [], ("compiled while serving:\n" + "\n".join(found["serving"]) + "\nwarm-up compiled:\n"
                                    + "\n".join(d for ds in found["warmed"].values() for d in ds))
