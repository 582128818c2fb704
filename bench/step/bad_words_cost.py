"""What multi-token bad words add per step (issue 34), and the cost per streamed event.

64 sampling rows of a 151,936-token vocabulary (Qwen3's): the whole logits controls of one step (built, applied,
recorded) for rows with a logit bias only, and the part that multi-token bad words add when each row carries
four (`afd.engine.sampling.banned_words`: built, applied, recorded). Also the cost per streamed event of `StreamEvents` on
a plain output. Runs on CPU (or `--device cuda`).

    .venv/bin/python bench/step/bad_words_cost.py [--device cpu] [--steps 50]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime")]  # `bench` and this checkout's `afd` (run as bench/<folder>/<name>.py)

from afd.engine.request import Request, RequestOutput, SamplingParams  # noqa: E402
from afd.engine.sampling.banned_words import step_words  # noqa: E402
from afd.engine.sampling.logits_controls import ControlState, step_controls  # noqa: E402
from afd.server.api.sse import StreamEvents  # noqa: E402

VOCAB, ROWS = 151_936, 64
WORDS = ((11, 12, 13), (21, 22), (31, 32, 33, 34), (41, 42))


def per_step_ms(params: SamplingParams, device: str, steps: int, words_only: bool = False) -> float:
    requests = [Request([1, 2, 3], params, lambda out: None) for _ in range(ROWS)]
    state, logits = ControlState(VOCAB, device), torch.randn(ROWS, VOCAB, device=device)
    chosen = torch.randint(0, VOCAB, (ROWS,), device=device)
    step_controls(state, requests, set())  # slots taken
    best = float("inf")
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            if words_only:
                words = step_words(requests, state.slots, state.device)
                words.apply(logits, state.history, state.written)
                words.record(chosen, state.history, state.written)
                continue
            controls = step_controls(state, requests, set())
            controls.apply(logits)
            controls.record(chosen)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - started) / steps * 1e3)
    return best


def per_event_ns(n: int = 200_000) -> float:
    events = StreamEvents(SimpleNamespace(model_name="tiny", tokenizer=None), "abc", "text_completion")
    output = RequestOutput("abc", " word", [7], [], finished=False, finish_reason=None)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(n):
            events.completion(output, "")
        best = min(best, (time.perf_counter() - started) / n * 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    bias = SamplingParams(max_tokens=64, logit_bias=((5, 1.0),))
    words = SamplingParams(max_tokens=64, logit_bias=((5, 1.0),), banned_sequences=WORDS)
    print(f"controls per step, {ROWS} rows, logit_bias only: {per_step_ms(bias, args.device, args.steps):.2f} ms")
    print(f"what 4 multi-token bad words per row add per step: "
          f"{per_step_ms(words, args.device, args.steps, words_only=True):.3f} ms")
    print(f"StreamEvents.completion per plain event: {per_event_ns():.0f} ns")


if __name__ == "__main__":
    main()
