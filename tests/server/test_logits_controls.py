"""Logits controls: each equals its reference (transformers' logits processors, OpenAI's penalty formula) on the
sampler, and greedy generation with them equals transformers' `generate` on both model families (fp32 CPU)."""

import pytest
import torch

from afd.engine.engine import Engine
from afd.engine.request import InvalidRequest, Request, SamplingParams
from afd.engine.sampling.logits_controls import ControlState, step_controls
from afd.engine.sampling.sampler import mask_min_p, sample
from afd.engine.text.stop_strings import StopChecker
from afd.engine.text.tokenizer import load_tokenizer
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic_runner import MonolithicRunner
from tests.server.conftest import submit_all

VOCAB = 64
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43]]


def request(prompt, **params) -> Request:
    return Request(list(prompt), SamplingParams(max_tokens=32, **params), lambda out: None)


def controlled(logits, requests, outputs=(), eos=()):
    """`logits` after the controls of `requests`, whose outputs so far are `outputs[i]` (counted as sampled)."""
    state = ControlState(logits.shape[1], "cpu")
    for step in range(max((len(o) for o in outputs), default=0)):
        for r in requests:
            r.scheduled_outputs += 1
        controls = step_controls(state, requests, set(eos))
        controls.record(torch.tensor([o[step] for o in outputs]))
    for r in requests:
        r.scheduled_outputs += 1
    return step_controls(state, requests, set(eos)).apply(logits)


def test_repetition_penalty_equals_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB) * 3
    prompts, outputs = [[1, 2, 3, 3], [7, 8]], [[4, 1], [9, 9]]
    got = controlled(logits, [request(p, repetition_penalty=1.3) for p in prompts], outputs)
    for row in range(2):
        seen = torch.tensor([prompts[row] + outputs[row]])
        want = RepetitionPenaltyLogitsProcessor(1.3)(seen, logits[row: row + 1].clone())[0]
        torch.testing.assert_close(got[row], want)


def test_presence_and_frequency_penalties_follow_openai_formula():
    torch.manual_seed(1)
    logits = torch.randn(1, VOCAB)
    output = [4, 4, 9, 4, 20]
    got = controlled(logits, [request([1, 4, 30], presence_penalty=0.5, frequency_penalty=-0.75)], [output])[0]
    want = logits[0].clone()
    for token in set(output):  # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        want[token] -= output.count(token) * -0.75 + 0.5
    torch.testing.assert_close(got, want)  # the prompt's tokens (1, 30) are not penalized


def test_only_rows_with_controls_change_and_the_input_is_left_alone():
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    got = controlled(logits, [request([1]), request([2], presence_penalty=1.0), request([3])], [[5], [5], [5]])
    torch.testing.assert_close(logits, before)
    torch.testing.assert_close(got[[0, 2]], before[[0, 2]])
    assert got[1, 5] == before[1, 5] - 1.0


def test_logit_bias_allowed_and_banned_tokens():
    logits = torch.zeros(1, VOCAB)
    got = controlled(logits, [request([1], logit_bias=((7, 100.0), (8, -5.0)))])[0]
    assert got[7] == 100 and got[8] == -5 and got.argmax() == 7
    allowed = controlled(logits, [request([1], allowed_token_ids=(3, 9), banned_token_ids=(9,))])[0]
    assert torch.isfinite(allowed).nonzero().flatten().tolist() == [3]


def test_min_tokens_holds_back_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, VOCAB)

    def after(outputs):  # the logits of the output after `outputs`, with min_tokens=2
        return controlled(logits, [request([1], min_tokens=2, stop_token_ids=(11,))], [outputs] if outputs else (),
                          eos=(2,))[0]

    for outputs in ([], [5]):  # outputs #1 and #2: EOS and the stop token held back, nothing else
        held = after(outputs)
        assert held[2] == held[11] == float("-inf") and torch.isfinite(held).sum() == VOCAB - 2
    assert torch.isfinite(after([5, 6])).all()  # output #3: free


def test_min_p_equals_transformers_warper():
    from transformers import MinPLogitsWarper

    torch.manual_seed(2)
    scores = torch.randn(3, VOCAB) * 2
    for min_p in (0.05, 0.3, 0.9):
        got = mask_min_p(scores, torch.full((3,), min_p))
        want = MinPLogitsWarper(min_p, min_tokens_to_keep=1)(None, scores.clone())
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got[torch.isfinite(got)], scores[torch.isfinite(got)])


def test_sampling_with_min_p_draws_only_kept_tokens():
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0] + [-9.0] * (VOCAB - 4)] * 64)
    params = [SamplingParams(temperature=1.0, min_p=0.5)] * 64
    drawn = sample(logits, params, [None] * 64).to_host().result()[0]
    assert set(drawn) <= {0, 1} and len(set(drawn)) == 2


def test_a_batch_without_controls_takes_no_controls():
    assert step_controls(ControlState(VOCAB, "cpu"), [request([1]), request([2], min_p=0.2)], {2}) is None


def test_slots_are_reused_after_their_requests_leave():
    state = ControlState(VOCAB, "cpu")
    first = [request([1], presence_penalty=1.0) for _ in range(10)]
    step_controls(state, first, set())
    assert state.counts.shape[0] == 16
    state.release(set(first[:2]))
    step_controls(state, [request([1], frequency_penalty=1.0) for _ in range(14)], set())
    assert state.counts.shape[0] == 16 and len(state.slots) == 16


def test_out_of_range_values_name_their_field():
    for field, value in [("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("min_p", 1.5), ("min_tokens", 99)]:
        with pytest.raises(InvalidRequest) as caught:
            SamplingParams(max_tokens=4, **{field: value})
        assert caught.value.param == field


def test_a_stop_string_is_kept_in_the_text_when_asked():
    kept, cut = StopChecker(("END",), include_stop=True), StopChecker(("END",))
    for checker in (kept, cut):
        checker.add("abcEN")
        checker.add("Dxyz")
    assert kept.take(final=True) == "abcEND" and cut.take(final=True) == "abc"


# -- generation: the engine (pipelined) against transformers and a reference loop -------------------------------
@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v2"])
def family(request, checkpoints):
    return request.param, checkpoints[request.param]


def engine_outputs(checkpoint, requests, eos=()):
    loaded = load_model(str(checkpoint))
    cache = KVCache.for_tokens(loaded.model.kv_layouts(), 4096, torch.float32, "cpu")
    engine = Engine(MonolithicRunner(loaded, cache), cache, load_tokenizer(str(checkpoint)), eos, max_num_seqs=8,
                    max_model_len=256, pipeline=True)
    engine.start()
    try:
        outputs = submit_all(engine, requests).wait(120)
        assert cache.usage == 0
    finally:
        engine.stop()
    return [[t for o in outs for t in o.token_ids] for outs in outputs], [outs[-1].finish_reason for outs in outputs]


def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model


def test_greedy_repetition_penalty_equals_transformers_generate(family):
    name, checkpoint = family
    model = hf_model(checkpoint)
    want = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, repetition_penalty=1.3,
                           pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    penalized = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    # mixed batch: plain rows next to penalized ones
    got, _ = engine_outputs(checkpoint, [(p, penalized) for p in PROMPTS] + [(p, plain) for p in PROMPTS])
    assert got[: len(PROMPTS)] == want, name
    assert got[len(PROMPTS):] != want  # the penalty changed something on this model


def test_greedy_presence_and_frequency_penalties_equal_a_reference_loop(family):
    _, checkpoint = family
    model = hf_model(checkpoint)
    want = []
    for prompt in PROMPTS:
        ids, out = list(prompt), []
        for _ in range(10):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
            logits = logits - 0.4 * counts - 0.8 * (counts > 0).float()
            out.append(int(logits.argmax()))
            ids.append(out[-1])
        want.append(out)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.4)
    got, _ = engine_outputs(checkpoint, [(p, params) for p in PROMPTS])
    assert got == want


def test_logit_bias_forces_a_token_and_min_tokens_holds_eos_back(checkpoints):
    forced = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias=((17, 100.0),))
    eos_first = SamplingParams(max_tokens=8, temperature=0, logit_bias=((23, 100.0),), min_tokens=3)
    got, reasons = engine_outputs(checkpoints["qwen3_moe"], [(PROMPTS[0], forced), (PROMPTS[1], eos_first)], eos=(23,))
    assert got[0] == [17] * 6 and reasons[0] == "length"
    assert len(got[1]) == 4 and 23 not in got[1][:3] and got[1][3] == 23 and reasons[1] == "stop"


def test_an_engine_over_a_bare_step_and_no_tokenizer_length_still_builds():
    from afd.engine.offline import _NoText
    from afd.kv.cache import KVBlocks

    engine = Engine(lambda ids, layout: None, KVBlocks(1), _NoText(), (), max_num_seqs=1, max_model_len=8)
    assert engine.vocab_size is None  # no grammar masks possible; nothing else needs it


def test_multi_token_bad_words_ban_the_last_token_only_after_their_prefix():
    words = ((3, 4, 5), (9, 5), (7, 8))
    logits = torch.zeros(4, VOCAB)
    outputs = [[1, 3, 4], [2, 9, 4], [0, 9, 3], [3, 4, 7]]  # row 0 ends with 3 4; row 1 with 4; 2 with 9 3; 3 with 7
    got = controlled(logits, [request([3, 4], banned_sequences=words) for _ in outputs], outputs)
    banned = [set(torch.nonzero(row.isinf()).flatten().tolist()) for row in got]
    assert banned == [{5}, set(), set(), {8}]  # row 2: 9 then 3 is no prefix; the prompt's 3 4 never counts
    carried = Request([3, 4, 9], SamplingParams(max_tokens=8, banned_sequences=words), lambda out: None)
    carried.carried = 1  # 9 came from an earlier rank: it is output
    assert set(torch.nonzero(controlled(torch.zeros(1, VOCAB), [carried])[0].isinf()).flatten().tolist()) == {5}


def test_a_taken_back_step_takes_its_tokens_out_of_the_bad_words_tail():
    state = ControlState(VOCAB, "cpu")
    requests = [request([1], banned_sequences=((3, 4, 5),))]
    for token in (3, 4):
        step_controls(state, requests, set()).record(torch.tensor([token]))
    lost = step_controls(state, requests, set())
    lost.record(torch.tensor([6]))
    assert not lost.apply(torch.zeros(1, VOCAB)).isinf().any()  # the tail is 3 4 6 now
    lost.words.undo(state.written)
    after = step_controls(state, requests, set()).apply(torch.zeros(1, VOCAB))[0]
    assert torch.nonzero(after.isinf()).flatten().tolist() == [5]
