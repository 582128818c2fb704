"""The messages between the API process and the engine core, and the text the API makes from token ids."""

from afd.engine.request import RequestOutput, SamplingParams, TokenLogprobs
from afd.server import core_wire
from afd.server.core_wire import CoreState
from afd.server.request_text import RequestText


def test_a_submit_carries_every_sampling_parameter():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop=("a", "bc"),
                            stop_token_ids=(4,), ignore_eos=True, logprobs=2)
    assert core_wire.decode_request(core_wire.encode_submit("r1", [1, 2, 3], params)) == (
        core_wire.SUBMIT, "r1", [1, 2, 3], params)
    assert core_wire.decode_request(core_wire.encode_abort("r1")) == (core_wire.ABORT, "r1")
    assert core_wire.decode_request(core_wire.encode_beat(True, None)) == (core_wire.BEAT, True, None)


def test_a_burst_of_outputs_and_the_core_state_arrive_as_sent():
    outputs = [RequestOutput("a", "", [5], [TokenLogprobs(5, -0.25, [(5, -0.25), (6, -1.5)])], prompt_tokens=3,
                             completion_tokens=1),
               RequestOutput("b", "", [], [], finished=True, finish_reason="error", error="the FFN is gone")]
    state = CoreState("the FFN link is down", "draining: the pod is stopping")
    assert core_wire.decode_outputs(core_wire.encode_outputs(state, outputs)) == (state, outputs)


class Letters:
    """A tokenizer of one letter per id (id 0 is 'a'), enough for the detokenizer."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def output(token: int, finished=False, reason=None) -> RequestOutput:
    return RequestOutput("r", "", [token], [], finished=finished, finish_reason=reason)


def test_a_stop_string_ends_the_request_in_the_api_with_the_text_before_it():
    text = RequestText(Letters(), ("cd",))
    steps = [output(0), output(1), output(2), output(3), output(4)]
    ended = [text.fill(o) for o in steps[:4]]
    assert [o.text for o in steps[:4]] == ["", "a", "b", ""]  # one letter held back: it may begin "cd"
    assert ended == [False, False, False, True]
    assert (steps[3].finished, steps[3].finish_reason) == (True, "stop")


def test_eos_and_length_finish_as_the_core_says_with_the_held_text_flushed():
    text = RequestText(Letters(), ("cx",))
    first, eos = output(2), output(9, finished=True, reason="stop")  # EOS: its token is not shown
    assert not text.fill(first) and first.text == ""
    assert not text.fill(eos) and eos.text == "c"
    length = RequestText(Letters(), ())
    last = output(1, finished=True, reason="length")
    assert not length.fill(last) and (last.text, last.finish_reason) == ("b", "length")
