"""n > 1 with the prompt prefilled once (issue 34): tokens fed, KV blocks in use and wall time of one request of n
choices, shared (one group) and as n separate requests, on a tiny CPU model (fp32). Prints one line per n.

    .venv/bin/python bench/serving/shared_prompt.py --prompt 512 --tokens 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from afd.engine.engine import Engine  # noqa: E402
from afd.engine.request import SamplingParams  # noqa: E402
from afd.engine.text.tokenizer import load_tokenizer  # noqa: E402
from afd.kv.cache import KVCache  # noqa: E402
from afd.models.loader import load_model  # noqa: E402
from afd.runners.monolithic_runner import MonolithicRunner  # noqa: E402
from afd.checkpoint_tools.tiny import make_tiny_model  # noqa: E402


class Counting:
    def __init__(self, runner):
        self.runner, self.fed, self.most_blocks = runner, 0, 0

    def __call__(self, input_ids, layout):
        self.fed += input_ids.numel()
        cache = self.runner.kv_cache
        self.most_blocks = max(self.most_blocks, cache.num_blocks - cache.free_blocks)
        return self.runner(input_ids, layout)


def run(loaded, tokenizer, prompt, n, tokens, group):
    cache = KVCache.for_tokens(loaded.model.kv_layouts(), n * (len(prompt) + tokens) + 64, torch.float32, "cpu")
    step = Counting(MonolithicRunner(loaded, cache))
    engine = Engine(step, cache, tokenizer, (), max_num_seqs=n, max_model_len=len(prompt) + tokens + 1,
                    max_num_batched_tokens=8192).start()
    done, started = [], time.perf_counter()
    try:
        with engine.together():
            for j in range(n):
                engine.submit(prompt, SamplingParams(max_tokens=tokens, temperature=1.0, seed=j, ignore_eos=True),
                              lambda out: out.finished and done.append(out), group=group)
        while len(done) < n:
            time.sleep(0.001)
    finally:
        engine.stop()
    return step.fed, step.most_blocks, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    folder = make_tiny_model("qwen3_moe", Path(tempfile.mkdtemp()) / "qwen3_moe", seed=0)
    loaded, tokenizer = load_model(str(folder)), load_tokenizer(str(folder))
    prompt = [(7 * i + 3) % 300 + 5 for i in range(args.prompt)]
    for n in (2, 4, 8):
        shared = [run(loaded, tokenizer, prompt, n, args.tokens, "g") for _ in range(args.repeats)]
        alone = [run(loaded, tokenizer, prompt, n, args.tokens, None) for _ in range(args.repeats)]
        wall = statistics.median(s[2] for s in shared), statistics.median(a[2] for a in alone)
        print(f"n={n} prompt={args.prompt} tokens={args.tokens}: fed {shared[0][0]} vs {alone[0][0]} tokens, "
              f"KV blocks {shared[0][1]} vs {alone[0][1]}, wall {wall[0] * 1e3:.0f} vs {wall[1] * 1e3:.0f} ms "
              f"(median of {args.repeats}; ratio {wall[0] / wall[1]:.2f})")


if __name__ == "__main__":
    main()
