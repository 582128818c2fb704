"""Prefix caching in the engine (CPU monolith, fp32): tokens with cache hits equal transformers' greedy ones and a run
with caching off, on Qwen3-MoE (GQA) and DeepSeek-V2/V3 (MLA's latent cache): a prefix ending mid-block, a whole
prompt already cached, hits across chunk boundaries, after eviction, concurrent requests on two shared prefixes, n
choices on a cached prefix, a step taken back (hold and resume), prompt logprobs, penalties and a grammar. At every
launch the block owners are checked (each block free once or held by exactly its counted owners)."""

import pytest
import torch

from afd.engine.request import SamplingParams
from afd.server.api.structured import grammar_of
from tests.server.test_engine_link_wait import FakeLink
from tests.server.test_shared_prompt_edges import Collected, make, settled, token_ids
from afd.engine.text.tokenizer import load_tokenizer
from afd.models.loader import load_model

SYSTEM = [(11 * i + 5) % 180 + 7 for i in range(40)]  # 2 full blocks and 8 tokens of a third (block size 16)
OTHER = [(13 * i + 2) % 170 + 9 for i in range(37)]
TAILS = [[21, 22, 23, 24, 25, 26, 27, 28], [31, 32, 33], [41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55,
                                                             56, 57, 58, 59, 60]]
NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "deepseek_v2"])
def family(request, checkpoints):
    path = str(checkpoints[request.param])
    return request.param, path, (load_model(path), load_tokenizer(path))


def hf_greedy(path, prompts, new=NEW):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return [model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts]


def one_by_one(parts, prompts, caching, params=GREEDY, budget=12, tokens=1024, link=None, hold_s=0.0):
    """Each prompt after the previous one finished (so it may hit what they published); (outputs, engine)."""
    engine, probe = make(parts, tokens=tokens, budget=budget, prefix_caching=caching, link=link, hold_s=hold_s)
    engine.start()
    results = []
    try:
        for prompt in prompts:
            outputs = Collected(1)
            engine.submit(prompt, params, outputs.collector(0))
            results.append(outputs.wait([0])[0])
        settled(engine, probe)
    finally:
        engine.stop()
    assert all(o.error is None for outs in results for o in outs)
    return results, engine


def test_hits_mid_block_whole_prompt_and_across_chunks_equal_transformers_and_caching_off(family):
    name, path, parts = family
    first = SYSTEM + TAILS[0]  # 48 tokens: 3 full blocks
    prompts = [first, SYSTEM + TAILS[1], first, first + TAILS[2], OTHER]
    on, engine = one_by_one(parts, prompts, caching=True)
    off, _ = one_by_one(parts, prompts, caching=False)
    assert [token_ids(o) for o in on] == [token_ids(o) for o in off] == hf_greedy(path, prompts)
    # the 40-token prefix ends mid-block: 2 blocks hit; the whole first prompt: its 3rd block holds its last token;
    # the longer one: every block of the first prompt (fed in 12-token chunks across block boundaries)
    assert [outs[-1].cached_tokens for outs in on] == [0, 32, 32, 48, 0]
    assert [outs[-1].cached_tokens for outs in off] == [0] * 5
    counts = engine.scheduler.prefix_counts
    assert counts.hits == 32 + 32 + 48 and counts.queries == sum(map(len, prompts))


def test_after_eviction_under_a_small_cache_tokens_are_unchanged(family):
    _, _, parts = family
    prompts = [SYSTEM + TAILS[0], OTHER + TAILS[1], [p + 1 for p in OTHER] + TAILS[0],
               [p + 2 for p in OTHER] + TAILS[2], SYSTEM + TAILS[1]]
    # 8 blocks, 3 or 4 reserved per request: the fourth evicts the first prompt's blocks, least recently used
    on, engine = one_by_one(parts, prompts, caching=True, tokens=8 * 16)
    off, _ = one_by_one(parts, prompts, caching=False, tokens=8 * 16)
    assert [token_ids(o) for o in on] == [token_ids(o) for o in off]
    assert on[4][-1].cached_tokens < 32  # SYSTEM's blocks were evicted (at least its second)
    assert engine.kv_cache.pool.cached_blocks <= engine.kv_cache.num_blocks


def concurrent(parts, prompts, params, caching, seats=4, group=None):
    engine, probe = make(parts, max_num_seqs=seats, budget=64, prefix_caching=caching)
    outputs = Collected(len(prompts))
    with engine.together():
        for index, (prompt, sampling) in enumerate(zip(prompts, params)):
            engine.submit(prompt, sampling, outputs.collector(index), request_id=f"r{index}", group=group)
    engine.start()
    try:
        results = outputs.wait(range(len(prompts)))
        settled(engine, probe)
    finally:
        engine.stop()
    assert all(o.error is None for outs in results for o in outs)
    return results


def test_sixteen_concurrent_requests_on_two_shared_prefixes_equal_caching_off(family):
    _, _, parts = family
    prompts = [(SYSTEM if i % 2 else OTHER) + [60 + i, 61 + i, 62 + i] for i in range(16)]
    on = concurrent(parts, prompts, [GREEDY] * 16, caching=True)
    off = concurrent(parts, prompts, [GREEDY] * 16, caching=False)
    assert [token_ids(o) for o in on] == [token_ids(o) for o in off]
    hits = [outs[-1].cached_tokens for outs in on]
    assert sum(h > 0 for h in hits) >= 8  # 4 seats: the later waves find the first wave's prefixes


def test_n_choices_penalties_and_a_grammar_on_a_cached_prefix_equal_caching_off(family):
    _, _, parts = family
    seeded = [SamplingParams(max_tokens=NEW, temperature=1.0, seed=7 + j, ignore_eos=True, presence_penalty=0.5,
                             repetition_penalty=1.3) for j in range(4)]
    tokenizer = parts[1]
    grammar, _ = grammar_of({"guided_regex": "[ab]{3,5}"})
    structured = SamplingParams(max_tokens=NEW, temperature=0.0, grammar=grammar)

    def run(caching):
        engine, probe = make(parts, prefix_caching=caching)
        engine.start()
        try:
            warm = Collected(1)
            engine.submit(SYSTEM + TAILS[0], GREEDY, warm.collector(0))
            warm.wait([0])
            choices = Collected(5)
            with engine.together():
                for j, sampling in enumerate(seeded):
                    engine.submit(SYSTEM + TAILS[2], sampling, choices.collector(j), request_id=f"c{j}", group="g")
                engine.submit(SYSTEM + TAILS[1], structured, choices.collector(4), request_id="s")
            results = choices.wait(range(5))
            settled(engine, probe)
        finally:
            engine.stop()
        assert all(o.error is None for outs in results for o in outs)
        return results

    on, off = run(True), run(False)
    assert [token_ids(o) for o in on] == [token_ids(o) for o in off]
    assert [outs[-1].cached_tokens for outs in on] == [32] * 5
    text = tokenizer.decode(token_ids(on[4]), skip_special_tokens=True)
    assert set(text) <= {"a", "b"}


def test_prompt_logprobs_are_computed_in_full_not_taken_from_the_cache(family):
    _, _, parts = family
    asking = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    on, _ = one_by_one(parts, [SYSTEM + TAILS[0], SYSTEM + TAILS[0]], caching=True, params=asking)
    off, _ = one_by_one(parts, [SYSTEM + TAILS[0]], caching=False, params=asking)
    shown = lambda outs: [(e.token_id, round(e.logprob, 5)) for e in outs[0].prompt_logprobs[1:]]  # noqa: E731
    assert on[1][-1].cached_tokens == 0 and len(on[1][0].prompt_logprobs) == len(SYSTEM) + len(TAILS[0])
    assert shown(on[1]) == shown(off[0])


@pytest.mark.parametrize("lose_at", [3, 11, 12, 14])  # the first prompt's prefill; the hit's prefill, last chunk, decode
def test_a_step_taken_back_never_publishes_and_tokens_equal_caching_off(family, lose_at):
    name, _, parts = family
    if name == "deepseek_v2":
        pytest.skip("MLA is covered by deepseek_v3")
    prompts = [SYSTEM + TAILS[2], SYSTEM + TAILS[0]]
    params = SamplingParams(max_tokens=NEW, temperature=1.0, seed=3, ignore_eos=True, frequency_penalty=0.4)
    on, engine = one_by_one(parts, prompts, caching=True, params=params, budget=12,
                            link=FakeLink([], lose_at=lose_at), hold_s=10.0)
    off, _ = one_by_one(parts, prompts, caching=False, params=params, budget=12)
    assert [token_ids(o) for o in on] == [token_ids(o) for o in off]
    assert on[1][-1].cached_tokens == 32


def test_choices_whose_leader_ends_mid_prefill_go_on_from_its_published_blocks(checkpoints):
    """n = 4 seeded choices, 16-token chunks of a 40-token prompt: the leader aborted at the launch of its second
    chunk (the first one read); the first rider prefills from the published block on (never writing it again) and
    every survivor equals its separate run."""
    from tests.server.test_shared_prompt_edges import PROMPT, seeded, separate, submit

    path = str(checkpoints["qwen3_moe"])
    parts = (load_model(path), load_tokenizer(path))
    params = seeded()
    engine, probe = make(parts, budget=16, prefix_caching=True)
    outputs = submit(engine, params)
    at = 2
    probe.hooks[at] = lambda: engine.abort("c0")
    engine.start()
    try:
        results = outputs.wait([1, 2, 3])
        settled(engine, probe)
    finally:
        engine.stop()
    assert all(o.error is None for i in (1, 2, 3) for o in results[i])
    expected = separate(parts, params)
    assert [token_ids(results[i]) for i in (1, 2, 3)] == expected[1:]
    # the leader's chunks (the last one in flight when it ended), the rest of the prompt after the published blocks,
    # the survivors' decodes: the published part is never fed again (without it, 16 * (at - 1) more)
    assert probe.fed == 16 * at + len(PROMPT) - 16 * (at - 1) + 3 * (6 - 1), probe.fed


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    """A tiny DeepSeek-V3.2 (16 keys a query, 8 index heads): the prompts below run past index_topk, so a hit's
    suffix chooses among index keys that the cached blocks hold."""
    from afd.checkpoint_tools.tiny import make_tiny_model

    path = str(make_tiny_model("deepseek_v32", tmp_path_factory.mktemp("v32") / "deepseek_v32", seed=0))
    return path, (load_model(path), load_tokenizer(path))


def test_deepseek_v32_hits_read_the_cached_index_keys_and_equal_transformers_and_caching_off(v32):
    """Issue 53: a prefix-cache hit on DeepSeek-V3.2 (the index-key cache rides on the latent cache's blocks)."""
    path, parts = v32
    first = SYSTEM + TAILS[0]
    prompts = [first, SYSTEM + TAILS[1], first + TAILS[2]]
    on, _ = one_by_one(parts, prompts, caching=True)
    off, _ = one_by_one(parts, prompts, caching=False)
    assert [token_ids(o) for o in on] == [token_ids(o) for o in off] == hf_greedy(path, prompts)
    assert [outs[-1].cached_tokens for outs in on] == [0, 32, 48]
