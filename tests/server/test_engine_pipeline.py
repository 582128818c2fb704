"""The pipelined engine loop gives exactly what the step-by-step loop gives, and both what greedy_generate gives."""


import pytest
import torch

from afd.engine.engine import Engine
from afd.engine.request import SamplingParams
from afd.engine.scheduling.step_cost import PrefillPacer, StepCostModel
from afd.engine.text.tokenizer import load_tokenizer
from afd.engine.generation import greedy_generate
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic_runner import MonolithicRunner
from tests.server.conftest import submit_all

PROMPTS = [[5 + i, 6 + 2 * i, 7, 8 + i % 5, 9][: 2 + i % 4] for i in range(12)]


@pytest.fixture(scope="module")
def parts(checkpoints):
    loaded = load_model(str(checkpoints["qwen3_moe"]))
    return loaded, load_tokenizer(str(checkpoints["qwen3_moe"]))


def run_engine(parts, requests, pipeline: bool, eos=(), budget=8192, runner=None, link=None, pacer=None):
    """Submit every (prompt, params) at once; the outputs of each, in order (on `runner`, else a CPU monolith;
    `link`: the attention runner's FFN link; `pacer`: the scheduler's prefill pacer)."""
    loaded, tokenizer = parts
    if runner is None:
        runner = MonolithicRunner(loaded, KVCache.for_tokens(loaded.model.kv_layouts(), 4096, torch.float32, "cpu"))
    cache = runner.kv_cache
    engine = Engine(runner, cache, tokenizer, eos, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=budget,
                    device=cache.keys[0].device, pipeline=pipeline, link=link)
    if pacer is not None:
        engine.scheduler.pacer = pacer
    engine.start()
    try:
        outputs = submit_all(engine, requests).wait(60)
        assert engine.num_running == 0 and cache.usage == 0
    finally:
        engine.stop()
    return [[(o.token_ids, o.text, o.finish_reason, [(l.token_id, round(l.logprob, 4), [t for t, _ in l.top])
                                                      for l in o.logprobs]) for o in outs] for outs in outputs]


def tokens_of(result):
    return [[t for ids, *_ in outs for t in ids] for outs in result]


def test_greedy_pipelined_equals_step_by_step_and_greedy_generate(parts):
    requests = [(p, SamplingParams(max_tokens=3 + i % 7, temperature=0, ignore_eos=True, logprobs=i % 3 or None))
                for i, p in enumerate(PROMPTS)]  # 12 requests, 8 seats: some join as others leave
    pipelined, stepwise = run_engine(parts, requests, True), run_engine(parts, requests, False)
    assert pipelined == stepwise
    loaded, _ = parts
    cache = KVCache.for_tokens(loaded.model.kv_layouts(), 4096, torch.float32, "cpu")
    for prompt, (_, params), tokens in zip(PROMPTS, requests, tokens_of(pipelined)):
        assert tokens == greedy_generate(MonolithicRunner(loaded, cache), cache, [prompt], params.max_tokens,
                                         ignore_eos=True).tokens[0]


def test_early_stops_and_seeded_sampling_match_step_by_step(parts):
    """EOS, stop tokens and stop strings end a request at the same token, though the pipeline ran a step ahead."""
    free = tokens_of(run_engine(parts, [(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))], False))[0]
    _, tokenizer = parts
    stop_text = tokenizer.decode(free[5:7])
    requests = [
        (PROMPTS[0], SamplingParams(max_tokens=12, temperature=0)),  # EOS = free[3] below
        (PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(free[4],))),
        (PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop_text,))),
        (PROMPTS[1], SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(max_tokens=10, temperature=1.0, seed=3, logprobs=2, ignore_eos=True)),
    ]
    pipelined = run_engine(parts, requests, True, eos=[free[3]])
    assert pipelined == run_engine(parts, requests, False, eos=[free[3]])
    assert [outs[-1][2] for outs in pipelined] == ["stop", "stop", "stop", "length", "length"]
    assert tokens_of(pipelined)[0] == free[:4] and tokens_of(pipelined)[1] == free[:5]
    assert stop_text not in "".join(text for _, text, *_ in pipelined[2])


def test_chunked_prefill_gives_the_same_tokens(parts):
    """With a 6-token step budget, prompts of up to 14 tokens are fed in chunks next to running decodes."""
    prompts = [list(range(3 + i, 3 + i + 4 + 2 * i)) for i in range(6)]
    requests = [(p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, seed=1)) for p in prompts]
    chunked = run_engine(parts, requests, True, budget=6)
    assert chunked == run_engine(parts, requests, False, budget=6) == run_engine(parts, requests, True)


def test_a_pacer_squeezing_prompts_next_to_decodes_gives_the_same_tokens(parts):
    """Ratio 1 with a one-token minimum: while anything decodes, prompts go in one token a step (then
    whatever the step times the engine measures allow)."""
    cost = StepCostModel()
    for tokens in (1, 4, 16, 64) * 3:
        cost.observe(tokens, 0.01 + 0.001 * tokens)
    pacer = PrefillPacer(1.0, min_tokens=1, cost=cost, decode_cost=cost)
    caps, cap_of = [], pacer.prefill_cap
    pacer.prefill_cap = lambda *args: caps.append(cap_of(*args)) or caps[-1]
    prompts = [list(range(3 + i, 3 + i + 4 + 3 * i)) for i in range(6)]
    requests = [(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for p in prompts]
    assert run_engine(parts, requests, True, budget=16, pacer=pacer) == run_engine(parts, requests, True, budget=16)
    assert any(cap is not None for cap in caps) and len(cost.curve()) >= 2


def test_the_engine_paces_prompts_only_when_asked(parts):
    loaded, tokenizer = parts
    cache = KVCache.for_tokens(loaded.model.kv_layouts(), 64, torch.float32, "cpu")
    off = Engine(MonolithicRunner(loaded, cache), cache, tokenizer, (), max_num_seqs=2, max_model_len=32)
    on = Engine(MonolithicRunner(loaded, cache), cache, tokenizer, (), max_num_seqs=2, max_model_len=32, prefill_itl_ratio=2)
    assert off.scheduler.pacer is None and on.scheduler.pacer is on.pacer and on.pacer.itl_ratio == 2


def test_a_request_taken_earlier_elsewhere_counts_its_time_from_there(parts):
    """`arrival` (the API process's clock reading) becomes the request's arrival; a later one is not believed."""
    import time

    loaded, tokenizer = parts
    cache = KVCache.for_tokens(loaded.model.kv_layouts(), 64, torch.float32, "cpu")
    engine = Engine(MonolithicRunner(loaded, cache), cache, tokenizer, (), max_num_seqs=2, max_model_len=32)  # not started
    earlier = time.monotonic() - 0.25
    assert engine.submit([1, 2], SamplingParams(max_tokens=1), lambda out: None, arrival=earlier).arrival == earlier
    later = engine.submit([1, 2], SamplingParams(max_tokens=1), lambda out: None, arrival=time.monotonic() + 60).arrival
    assert later <= time.monotonic()
