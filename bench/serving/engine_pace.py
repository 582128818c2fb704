"""The engine loop alone, without HTTP: does it keep pace with its own graph-replayed step?

    python3 bench/serving/engine_pace.py [--layers 27] [--levels 16,64,256]          # GPU: random V2-Lite-shaped bf16
    python3 bench/serving/engine_pace.py --device cpu --model <tiny> --levels 4      # CPU smoke

For each level B, B greedy requests (prompts of 128-1024 tokens, 256 outputs, ignore_eos) go through the
serving `Engine` over a monolithic rank (`AFD_ROLE=monolithic`'s stepper, decode graphs on a GPU), and the
rank's step ceiling is timed as `afd serve` times it (`afd.server.serve.ceiling.step_seconds`). Printed per level:
the steady decode interval (median time between a request's tokens once every prompt is in), the ceiling,
their ratio (pace), how many decode steps replayed a graph, and the host time per loop iteration by phase
(schedule, build inputs, step launch, sampling launch, waiting for the device, handing outputs over), and the
step-time curve the prefill pacer learned (medians by token count: decode-only steps at B tokens, mixed ones above).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

import afd.engine.engine as engine_module  # noqa: E402
from afd.config import AFDConfig  # noqa: E402
from afd.engine.engine import Engine  # noqa: E402
from afd.engine.outputs import OutputProcessor  # noqa: E402
from afd.engine.request import SamplingParams  # noqa: E402
from afd.engine.sampling.sampler import Sampled  # noqa: E402
from afd.roles.monolithic import build_monolithic  # noqa: E402
from afd.server.serve.ceiling import step_seconds  # noqa: E402


class PhaseClock:
    """Host seconds spent in named phases of the engine thread (wrapped callables)."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
        return timed


def run_level(role, batch: int, args, rng: random.Random) -> dict:
    clock = PhaseClock()
    steps = []

    class Steps:
        def on_step(self, _engine, tokens, seconds):
            steps.append((time.perf_counter(), tokens))

        def on_token(self, request, now):
            pass

        def on_error(self):
            pass

    engine = Engine(role.runner, role.kv_cache, None, [], max_num_seqs=batch, max_model_len=2048,
                    max_num_batched_tokens=args.max_num_batched_tokens, device=role.device,
                    prefill_itl_ratio=args.prefill_itl_ratio, observer=Steps())
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    runner = _ProfiledRunner(engine.step, args.profile_prompt_step)
    engine.step = clock.wrap("step launch", runner)
    originals = engine_module.build_inputs, engine_module.sample, Sampled.wait, OutputProcessor.tokens
    OutputProcessor.tokens = clock.wrap("outputs handed over", OutputProcessor.tokens)  # this level's one engine
    engine_module.build_inputs = clock.wrap("build inputs", engine_module.build_inputs)
    engine_module.sample = clock.wrap("sampling launch", engine_module.sample)
    Sampled.wait = clock.wrap("wait for device", Sampled.wait)
    token_times: dict[int, list[float]] = collections.defaultdict(list)
    done = threading.Event()
    finished = [0]
    lock = threading.Lock()

    def collect(index: int):
        def on_output(output) -> None:
            token_times[index].append(time.perf_counter())
            if output.finished:
                with lock:
                    finished[0] += 1
                    if finished[0] == batch:
                        done.set()
        return on_output

    replays_before = role.runner.graphs.replays if role.runner.graphs is not None else 0
    mixed = role.runner.mixed_graphs
    mixed_before = mixed.replays if mixed is not None else 0
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[rng.randrange(args.vocab) for _ in range(rng.randint(128, 1024))] for _ in range(batch)]
    engine.start()
    started = time.perf_counter()
    try:
        for i, prompt in enumerate(prompts):
            engine.submit(prompt, params, collect(i), text=False)
        if not done.wait(600):
            raise RuntimeError("the level did not finish in 600 s")
        wall = time.perf_counter() - started
    finally:
        engine.stop()
        engine_module.build_inputs, engine_module.sample, Sampled.wait, OutputProcessor.tokens = originals
    all_in = max(times[0] for times in token_times.values())  # every prompt has its first token: decode only after
    gaps = [b - a for times in token_times.values() for a, b in zip(times, times[1:]) if a >= all_in]
    gaps = gaps or [b - a for times in token_times.values() for a, b in zip(times, times[1:])]  # short CPU smoke runs
    decode_steps = [t for t, tokens in steps if t > all_in and tokens == batch]
    replays = (role.runner.graphs.replays - replays_before) if role.runner.graphs is not None else 0
    iterations = len(steps) or 1
    curve = engine.pacer.cost.curve() if engine.pacer is not None else []  # what the prefill pacer learned
    ceiling = step_seconds(role.runner, role.kv_cache, batch, vocab_size=args.vocab)
    interval = statistics.median(gaps)
    return {"batch": batch, "wall_s": wall, "steps": len(steps), "decode_steps": len(decode_steps),
            "graph_replays": replays, "piecewise_replays": (mixed.replays - mixed_before) if mixed is not None else 0,
            "all_prompts_in_s": all_in - started, "tokens_per_s": batch * args.output_tokens / wall,
            "step_tokens": _histogram([tokens for _, tokens in steps], batch), "decode_interval_ms": 1e3 * interval, "ceiling_ms": 1e3 * ceiling,
            "pace": ceiling / interval,
            "prompt_launch_ms_p50": statistics.median(runner.prompt_launch_ms) if runner.prompt_launch_ms else 0.0, "step_curve": [(round(t), round(1e3 * s, 2)) for t, s in curve],
            "phases_ms_per_step": {k: 1e3 * v / iterations for k, v in sorted(clock.seconds.items())}}


class _ProfiledRunner:
    """The rank's stepper, timing each prompt-carrying launch; the N-th such step of >= 1024 tokens
    runs under torch.profiler and its table (host time by op) is printed."""

    def __init__(self, runner, profile_at: int):
        self.runner, self.profile_at, self.seen = runner, profile_at, 0
        self.prompt_launch_ms: list[float] = []

    def __call__(self, input_ids, layout):
        if max(layout.new_lens) == 1:
            return self.runner(input_ids, layout)
        started = time.perf_counter()
        self.seen += layout.num_tokens >= 1024
        if self.profile_at and self.seen == self.profile_at and layout.num_tokens >= 1024:
            import torch

            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                logits = self.runner(input_ids, layout)
            print(f"profiled prompt step: {layout.num_tokens} tokens, {len(layout.new_lens)} sequences, "
                  f"{sum(n > 1 for n in layout.new_lens)} with prompt tokens")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50))
        else:
            logits = self.runner(input_ids, layout)
        self.prompt_launch_ms.append(1e3 * (time.perf_counter() - started))
        return logits


def _histogram(step_tokens: list[int], batch: int) -> dict[str, int]:
    """How many steps of each size: decode-only at the full batch, then by prompt-carrying token counts."""
    edges = (256, 512, 1024, 2048)
    counts = collections.Counter()
    for tokens in step_tokens:
        counts["full decode" if tokens == batch else f"<={next((e for e in edges if tokens <= e), 'more')}"] += 1
    return dict(sorted(counts.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: a random DeepSeek-V2-Lite-shaped one)")
    parser.add_argument("--checkpoint-dir", default="/tmp/afd-serve-gpu")
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--levels", default="16,64,256")
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--prefill-itl-ratio", type=float, default=2.0)
    parser.add_argument("--profile-prompt-step", type=int, default=0, help="profile the N-th prompt step of >= 1024 tokens")
    parser.add_argument("--mixed-graph-tokens", type=int, default=2048, help="piecewise prompt-step graphs (0: eager)")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    if args.model is None:
        from bench.harness.random_weights import write_v2_lite

        args.model = str(write_v2_lite(Path(args.checkpoint_dir) / f"v2lite-{args.layers}", args.layers, args.device))
    gpu = args.device == "cuda"
    args.vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    config = AFDConfig(role="monolithic", model=args.model, device=args.device, cuda_graphs=gpu,
                       max_num_seqs=max(levels), dtype="bfloat16" if gpu else "float32",
                       max_num_batched_tokens=args.max_num_batched_tokens, mixed_graph_tokens=args.mixed_graph_tokens)
    tokens = max(levels) * (1024 + args.output_tokens + 32)
    role = build_monolithic(config, tokens)
    rng = random.Random(0)
    print(f"{'batch':>6} {'steps':>6} {'replays':>8} {'decode ms':>10} {'ceiling ms':>11} {'pace':>5}  host ms per step",
          flush=True)
    for batch in levels:
        level = run_level(role, batch, args, rng)
        phases = ", ".join(f"{k} {v:.2f}" for k, v in level["phases_ms_per_step"].items())
        print(f"{batch:>6} {level['steps']:>6} {level['graph_replays']:>8} {level['decode_interval_ms']:>10.2f} "
              f"{level['ceiling_ms']:>11.2f} {level['pace']:>5.2f}  {phases}", flush=True)
        print(f"{'':>6} wall {level['wall_s']:.1f} s, {level['tokens_per_s']:.0f} tok/s, every prompt in after "
              f"{level['all_prompts_in_s']:.1f} s, piecewise replays {level['piecewise_replays']}; prompt-step launch p50 "
              f"{level['prompt_launch_ms_p50']:.1f} ms; steps by tokens "
              f"{level['step_tokens']}", flush=True)
        print(f"{'':>6} step time the pacer learned (tokens: ms): "
              + ", ".join(f"{t}: {ms}" for t, ms in level["step_curve"]), flush=True)
    role.close("benchmark done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
