"""Prompt logprobs from the prefill equal transformers' log-softmax (fp32 CPU), whole or in chunks, pipelined."""

import pytest
import torch

from afd.engine.engine import Engine
from afd.engine.request import RequestOutput, SamplingParams, TokenLogprobs
from afd.engine.text.tokenizer import load_tokenizer
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic_runner import MonolithicRunner
from afd.server.api_process import core_wire
from tests.server.conftest import submit_all

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 12], [3], [40, 41, 42, 43, 44, 45]]


def hf_prompt_logprobs(checkpoint, prompt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [T, vocab]: row p predicts p + 1


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2"])
@pytest.mark.parametrize("budget", [8192, 4])  # 4: prompts fed in chunks over several steps
def test_prompt_logprobs_equal_transformers(checkpoints, name, budget):
    checkpoint = checkpoints[name]
    loaded = load_model(str(checkpoint))
    cache = KVCache.for_tokens(loaded.model.kv_layouts(), 4096, torch.float32, "cpu")
    engine = Engine(MonolithicRunner(loaded, cache), cache, load_tokenizer(str(checkpoint)), (), max_num_seqs=8,
                    max_model_len=256, max_num_batched_tokens=budget)
    asked = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.start()
    try:
        outputs = submit_all(engine, [(p, asked) for p in PROMPTS] + [(PROMPTS[0], plain)]).wait(120)
    finally:
        engine.stop()
    for prompt, outs in zip(PROMPTS, outputs):
        shown = outs[0].prompt_logprobs
        assert all(o.prompt_logprobs is None for o in outs[1:])
        assert len(shown) == len(prompt) and shown[0] is None
        want = hf_prompt_logprobs(checkpoint, prompt)
        for p, entry in enumerate(shown[1:]):
            assert entry.token_id == prompt[p + 1]
            assert entry.logprob == pytest.approx(float(want[p, prompt[p + 1]]), abs=1e-4)
            assert entry.rank == int((want[p] > want[p, prompt[p + 1]]).sum()) + 1
            top = want[p].topk(2)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert outputs[-1][0].prompt_logprobs is None
    assert [t for o in outputs[-1] for t in o.token_ids] == [t for o in outputs[0] for t in o.token_ids]


def test_prompt_logprobs_cross_the_api_process_wire():
    entries = [None, TokenLogprobs(7, -1.5, [(7, -1.5), (3, -2.0)], 1)]
    out = RequestOutput("r", "x", [1], [], prompt_logprobs=entries)
    _, (decoded,) = core_wire.decode_outputs(core_wire.encode_outputs(core_wire.CoreState(None, None), [out]))
    assert decoded.prompt_logprobs == entries
