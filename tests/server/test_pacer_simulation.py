"""The scheduler and its prefill pacer against a model of an H200's step times: bursts and arriving prompts.

Step times fitted to the eleventh session's measurements (bench/RESULTS.md, DeepSeek-V2-Lite shapes, 27 layers): a
decode-only step replays a graph (6.6 ms at batch 1, 13.9 at 16, 15.8 at 64, 17.8 at 256); a step with prompt tokens
costs at least 14 ms (piecewise graphs, eager attention) plus 13 µs a prompt token. The loop is the engine's, without
the model: schedule, time the step, let the pacer observe it, hand out tokens, and start a stream's next request when
its last one ends. Deterministic, so it checks the policy, not the noise a real run adds.
"""

import random

import pytest
import torch

from afd.engine.request import Request, SamplingParams
from afd.engine.scheduling.scheduler import Scheduler
from afd.engine.scheduling.step_cost import PrefillPacer
from afd.kv.cache import KVCache
from afd.models.spec import KVLayout

DECODE_SECONDS = ((1, 0.0066), (16, 0.0139), (64, 0.0158), (256, 0.0178))  # batch → graph-replayed step


def step_seconds(decodes: int, prompt_tokens: int) -> float:
    for (b0, s0), (b1, s1) in zip(DECODE_SECONDS, DECODE_SECONDS[1:]):
        if decodes <= b1:
            decode = s0 + (s1 - s0) * (max(decodes, b0) - b0) / (b1 - b0)
            break
    else:
        decode = DECODE_SECONDS[-1][1]
    return max(decode, 0.014) + 13e-6 * prompt_tokens if prompt_tokens else decode


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def simulate(streams: int, requests_per_stream: int, output_tokens: int, pacer: PrefillPacer | None) -> dict:
    """Every stream sends its first request at 0 s (prompts of 128–1024 tokens) and its next one when the last ends."""
    rng, clock = random.Random(0), 0.0
    cache = KVCache([KVLayout(1, 2, 2)], streams * 90, torch.float32, "cpu", block_size=16)
    sched = Scheduler(cache, 256, 2048, max_model_len=2048, pacer=pacer)
    left, stream_of, arrival, last, produced, first_tokens, gaps = {}, {}, {}, {}, {}, [], []

    def submit(stream: int) -> None:
        request = Request(list(range(rng.randint(128, 1024))), SamplingParams(max_tokens=output_tokens), lambda out: None)
        stream_of[request], arrival[request], produced[request] = stream, clock, 0
        sched.add(request)

    for stream in range(streams):
        left[stream] = requests_per_stream - 1
        submit(stream)
    while sched.running or sched.waiting:
        batch = sched.schedule()
        prefilling = {r for r in batch if r.cached_tokens < len(r.prompt_ids)}
        prompt_tokens = sum(r.chunk for r in prefilling)
        seconds = step_seconds(len(batch) - len(prefilling), prompt_tokens)
        clock += seconds
        if pacer is not None:
            pacer.observe(len(batch) - len(prefilling) + prompt_tokens, seconds, prompt=prompt_tokens > 0)
        for request in batch:
            if request in prefilling:
                request.cached_tokens += request.chunk
                if request.cached_tokens < len(request.prompt_ids):
                    continue
                first_tokens.append(clock - arrival[request])
            else:
                request.cached_tokens += 1
                gaps.append(clock - last[request])
            last[request], produced[request] = clock, produced[request] + 1
            if produced[request] == output_tokens:
                sched.finish(request)
                if left[stream_of[request]]:
                    left[stream_of[request]] -= 1
                    submit(stream_of[request])
    assert len(first_tokens) == streams * requests_per_stream  # nothing lost
    return {"ttft_p50": percentile(first_tokens, 0.5), "ttft_max": max(first_tokens),
            "itl_ratio": percentile(gaps, 0.99) / percentile(gaps, 0.5)}


def test_a_burst_of_16_prompts_gets_its_first_tokens_as_fast_as_unpaced_and_all_within_the_deadline():
    paced, unpaced = simulate(16, 1, 256, PrefillPacer(2.0)), simulate(16, 1, 256, None)
    assert paced["ttft_p50"] == pytest.approx(unpaced["ttft_p50"], rel=0.1)  # the burst rule: no cap while they wait
    assert paced["ttft_max"] < 64 * 0.020  # the deadline floor: every prompt within 64 steps of ≤ 20 ms


def test_arriving_prompts_keep_itl_p99_within_twice_p50_where_unpaced_steps_do_not():
    assert simulate(64, 4, 128, PrefillPacer(2.0))["itl_ratio"] <= 2.0
    assert simulate(64, 4, 128, None)["itl_ratio"] > 2.5
