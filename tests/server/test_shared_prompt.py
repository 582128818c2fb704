"""The choices of one prompt (n > 1) share its prefill and full KV blocks: one prefill, fewer blocks, the same outputs
as separate requests with the same seeds (`afd.engine.scheduling.shared_prompt`)."""

import pytest
import torch

from afd.engine.engine import Engine
from afd.engine.request import Request, SamplingParams
from afd.engine.scheduling.scheduler import Scheduler
from afd.engine.text.tokenizer import load_tokenizer
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic_runner import MonolithicRunner
from tests.server.conftest import Outputs

N, MAX_TOKENS, BLOCK = 4, 6, 16


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


@pytest.fixture(scope="module", params=DEVICES)
def device_parts(checkpoints, request):
    """The model and tokenizer on each device: on a GPU the shared blocks' tail copies are device index copies."""
    path = str(checkpoints["qwen3_moe"])
    return load_model(path, device=request.param), load_tokenizer(path), request.param


@pytest.fixture(scope="module")
def parts(checkpoints):
    return load_model(str(checkpoints["qwen3_moe"])), load_tokenizer(str(checkpoints["qwen3_moe"]))


class Counting:
    """The runner, counting the tokens fed and the KV blocks in use at each step, and the decode rows (one token)
    that write into a block with more than one owner (`owners`, the scheduler's)."""

    def __init__(self, runner):
        self.runner, self.fed, self.most_blocks, self.shared_writes = runner, 0, 0, 0
        self.logit_rows, self.row_logits, self.owners = None, None, None

    def __call__(self, input_ids, layout):
        self.fed += input_ids.numel()
        cache = self.runner.kv_cache
        self.most_blocks = max(self.most_blocks, cache.num_blocks - cache.free_blocks)
        for table, context, new in zip(layout.block_tables, layout.context_lens, layout.new_lens):
            self.shared_writes += new == 1 and self.owners._extra.get(table[context // cache.block_size], 0) > 0
        return self.runner(input_ids, layout)


def run(parts, prompt, params_list, group, pipeline=True, budget=8192, device="cpu"):
    loaded, tokenizer = parts
    cache = KVCache.for_tokens(loaded.model.kv_layouts(), 1024, torch.float32, device)
    step = Counting(MonolithicRunner(loaded, cache))
    engine = Engine(step, cache, tokenizer, (), max_num_seqs=8, max_model_len=256, max_num_batched_tokens=budget,
                    device=device, pipeline=pipeline).start()
    step.owners = engine.scheduler.blocks
    try:
        outputs = Outputs(len(params_list))
        with engine.together():
            for index, params in enumerate(params_list):
                engine.submit(prompt, params, outputs.collector(index), group=group)
        results = outputs.wait(60)
        assert engine.num_running == 0 and cache.free_blocks == cache.num_blocks and not engine.scheduler.blocks.shared
    finally:
        engine.stop()
    return [_tokens(outs) for outs in results], step


def _tokens(outs) -> list[tuple]:
    """Every token of one request's outputs, each with its logprob (rounded) where they were asked for (else None)."""
    return [(t, round(o.logprobs[i].logprob, 4) if o.logprobs else None) for o in outs for i, t in enumerate(o.token_ids)]


@pytest.mark.parametrize("length", [40, 32])  # a partly filled last prompt block (copied per choice), and none
@pytest.mark.parametrize("pipeline", [True, False])
def test_n_choices_prefill_once_share_blocks_and_equal_separate_runs(device_parts, length, pipeline):
    *parts, device = device_parts
    prompt = [(7 * i + 3) % 200 + 5 for i in range(length)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11 + j, ignore_eos=True, logprobs=0)
              for j in range(N)]
    shared, step = run(parts, prompt, params, group="g", pipeline=pipeline, device=device)
    alone = [run(parts, prompt, [p], group=None, pipeline=pipeline, device=device)[0][0] for p in params]
    assert shared == alone and len({tuple(t) for t in shared}) > 1
    assert step.fed == length + N * (MAX_TOKENS - 1)  # the prompt once, then every choice's decodes
    assert step.shared_writes == 0  # every choice decodes into blocks of its own
    own = -(-(length + MAX_TOKENS) // BLOCK)
    assert step.most_blocks == own + (N - 1) * (own - length // BLOCK)  # the prompt's full blocks held once
    _, separate = run(parts, prompt, params, group=None, pipeline=pipeline, device=device)
    assert separate.fed == N * length + N * (MAX_TOKENS - 1) and separate.most_blocks == N * own


def test_chunked_prefill_riders_wait_for_the_last_chunk(parts):
    prompt = [(5 * i + 1) % 150 + 5 for i in range(40)]
    params = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True) for _ in range(3)]
    shared, step = run(parts, prompt, params, group="g", budget=16)  # the prompt in 3 chunks
    alone = [run(parts, prompt, [p], group=None, budget=16)[0][0] for p in params]  # each choice as its own request
    assert step.fed == 40 + 3 * 2 and shared == alone and all(len(tokens) == 3 for tokens in shared)


def test_a_leader_ending_before_its_prompt_is_in_hands_its_riders_over():
    cache = KVCache([], 16, torch.float32, "cpu", block_size=BLOCK)
    scheduler = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
    prompt = list(range(1, 41))
    requests = [Request(prompt, SamplingParams(max_tokens=8), lambda out: None, group="g") for _ in range(3)]
    for request in requests:
        scheduler.add(request)
    assert scheduler.schedule() == [requests[0]]  # the leader's first chunk; both others ride it
    assert [r.shares for r in requests[1:]] == [requests[0]] * 2 and requests[0].riders == requests[1:]
    assert scheduler.leaders == {requests[0]}
    assert cache.num_blocks - cache.free_blocks == 3 + 2 * 1 and scheduler.blocks.shared == 2
    requests[0].cached_tokens = 16
    scheduler.finish(requests[0])  # aborted mid-prompt: the first rider prefills, the other rides it
    assert requests[1].shares is None and requests[2].shares is requests[1] and requests[1].riders == [requests[2]]
    assert scheduler.leaders == {requests[1]}
    assert cache.num_blocks - cache.free_blocks == 2 + 1 + 1
    assert scheduler.schedule() == [requests[1]] and requests[1].chunk == 16
    for request in requests[1:]:
        scheduler.finish(request)
    assert cache.free_blocks == cache.num_blocks and not scheduler.blocks.shared and not scheduler.leaders


def test_a_lost_prefill_step_is_taken_back_and_the_choices_ride_it_again(parts):
    """The FFN lost at the wait for the step where the choices board their leader's prefill (hold and resume): that
    step and the next are taken back, the riders wait for the prefill again, and every choice equals an undisturbed
    run's."""
    from tests.server.test_engine_link_wait import FakeLink, make_engine, tokens

    prompt = list(range(5, 25))  # 20 tokens: a partly filled last block, copied per choice
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=21 + j, ignore_eos=True) for j in range(3)]

    def run_held(link):
        engine = make_engine(parts, link, [], link_check_s=0.05)
        engine.hold_s = 10.0
        outputs = Outputs(len(params))
        with engine.together():
            for index, sampling in enumerate(params):
                engine.submit(prompt, sampling, outputs.collector(index), group="g")
        engine.start()
        try:
            results = outputs.wait(30)
            assert engine.kv_cache.free_blocks == engine.kv_cache.num_blocks and not engine.scheduler.blocks.shared
        finally:
            engine.stop()
        assert all(o.error is None for outs in results for o in outs)
        return tokens(results), engine.step.launches

    held, launches = run_held(FakeLink([], lose_at=1))
    undisturbed, plain_launches = run_held(None)
    assert held == undisturbed and launches > plain_launches  # the lost step (and the one on top, if any) ran again
