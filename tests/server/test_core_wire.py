"""The messages between the API process and the engine core, and the text the API makes from token ids."""

import contextlib

from afd.engine.request import RequestOutput, SamplingParams, TokenLogprobs
from afd.server.api_process import core_wire
from afd.server.api_process.core_wire import CoreState
from afd.server.api_process.request_text import RequestText


def test_a_submit_carries_every_sampling_parameter():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop=("a", "bc"),
                            stop_token_ids=(4,), ignore_eos=True, logprobs=2)
    assert core_wire.decode_request(core_wire.encode_submit(2, "r1", [1, 2, 3], params, 12.5, "g")) == (
        core_wire.SUBMIT, 2, "r1", [1, 2, 3], params, 12.5, "g")
    assert core_wire.decode_request(core_wire.encode_abort(0, "r1")) == (core_wire.ABORT, 0, "r1")
    assert core_wire.decode_request(core_wire.encode_beat(1, True, None)) == (core_wire.BEAT, 1, True, None)


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


def test_the_api_side_reports_the_cores_state_and_its_silence(tmp_path):
    """A stand-in core on the link: its problem reaches `problem`; silence fails waiting requests."""
    import asyncio

    import zmq

    from afd.engine.request import SamplingParams
    from afd.kv_cache import KVBlocks
    from afd.server.api_process.core_link import addresses
    from afd.server.api_process.engine_client import EngineClient

    requests_at, outputs_at = addresses(str(tmp_path))
    context = zmq.Context()
    core_in, core_out = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    core_in.bind(requests_at)
    core_out.bind(outputs_at)
    client = EngineClient(str(tmp_path), Letters(), KVBlocks(8, 16), 4, 64, 128, silence_s=0.5, beat_s=0.05)
    got = []

    async def scenario():
        link = asyncio.create_task(client.run(lambda: True, lambda: None))
        assert client.problem == "the engine core has not answered yet"
        core_out.send(core_wire.encode_outputs(CoreState("the FFN link is down", "the FFN link is down"), []))
        await asyncio.sleep(0.2)
        assert client.problem == client.unready() == "the FFN link is down"
        core_out.send(core_wire.encode_outputs(CoreState(None, None), []))
        await asyncio.sleep(0.1)
        assert client.problem is None and client.unready() is None
        request = client.submit([1, 2], SamplingParams(max_tokens=3), got.append)
        while (message := core_wire.decode_request(core_in.recv()))[0] == core_wire.BEAT:
            assert message[1:] == (0, True, None)  # API process 0, listening, its loop turns
        kind, api, request_id, prompt, params, arrival, _ = message
        assert (kind, api, request_id, prompt, params.max_tokens) == (core_wire.SUBMIT, 0, request.request_id, [1, 2], 3)
        assert arrival == request.arrival  # the core's time to first token counts from the API's arrival
        core_out.send(core_wire.encode_outputs(CoreState(None, None), [RequestOutput(request_id, "", [0], [])]))
        await asyncio.sleep(1.0)  # then the core goes silent
        link.cancel()

    asyncio.run(scenario())
    assert [o.text for o in got] == ["a", ""] and got[-1].finish_reason == "error"
    assert "engine core has been silent" in got[-1].error and client.num_waiting_here == 0
    client.close()
    core_in.close(linger=0)
    core_out.close(linger=0)
    context.term()


def test_each_api_process_gets_the_outputs_of_its_own_requests_and_the_core_hears_them_all(tmp_path):
    """Two API processes on one core (`AFD_API_SERVERS=2`): outputs go back to the process that submitted."""
    import asyncio

    from afd.kv_cache import KVBlocks
    from afd.server.api_process.core_link import ApiLink
    from afd.server.api_process.engine_client import EngineClient

    class Echo:
        """An engine that answers every submit at once with one finished token, the prompt's first id."""

        on_burst = None

        def submit(self, prompt_ids, params, on_output, request_id, text, arrival, group):
            on_output(RequestOutput(request_id, "", [prompt_ids[0]], [], finished=True, finish_reason="length"))
            self.on_burst()

        def together(self):
            return contextlib.nullcontext()

        def abort(self, request_id):
            pass

    link = ApiLink(Echo(), str(tmp_path), lambda: CoreState(None, None), servers=2, beat_s=0.05).start()
    clients = [EngineClient(str(tmp_path), Letters(), KVBlocks(8, 16), 4, 64, 128, beat_s=0.05, api=api) for api in (0, 1)]
    got: list[list] = [[], []]

    async def scenario():
        loops = [asyncio.create_task(c.run(lambda: True, lambda: None)) for c in clients]
        while link.heard is None or not link.listening:
            await asyncio.sleep(0.02)
        for token in range(6):
            clients[token % 2].submit([token], SamplingParams(max_tokens=1), got[token % 2].append)
        while sum(map(len, got)) < 6:
            await asyncio.sleep(0.02)
        for task in loops:
            task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 20))
    assert [[o.token_ids[0] for o in outputs] for outputs in got] == [[0, 2, 4], [1, 3, 5]]
    assert link.problem() is None
    for client in clients:
        client.close()
    link.close()


def test_a_link_to_no_api_process_is_refused_before_it_binds(tmp_path):
    """0 API processes (a config with `api_children` 0 handed to the API-process core) is an error at once, not a
    link thread failing on every poll while nothing serves HTTP."""
    import types

    import pytest

    from afd.server.api_process.core_link import ApiLink

    engine = types.SimpleNamespace(on_burst=None)
    with pytest.raises(ValueError, match="1 or more API processes, got 0.*api_process or api_servers > 1"):
        ApiLink(engine, str(tmp_path), lambda: CoreState(None, None), servers=0).close()  # close: if it were made
    assert list(tmp_path.iterdir()) == []  # no socket bound


def test_a_dead_api_process_is_restarted_within_a_budget_of_deaths():
    from afd.server.api_process.core import RestartBudget

    budget = RestartBudget(limit=3, window_s=60)
    assert budget.allow(0) and budget.allow(10)
    assert not budget.allow(20)  # the third death within a minute: give up
    spaced = RestartBudget(limit=3, window_s=60)
    assert all(spaced.allow(t) for t in (0, 40, 80, 120, 160))  # never three within a minute


def test_the_requests_of_a_gone_api_process_are_aborted_in_the_engine(tmp_path):
    from afd.server.api_process.core_link import ApiLink

    class Engine:
        on_burst = None

        def __init__(self):
            self.aborted, self.callbacks = [], {}

        def submit(self, prompt_ids, params, on_output, request_id, text, arrival, group=None):
            self.callbacks[request_id] = on_output

        def abort(self, request_id):
            self.aborted.append(request_id)

    engine = Engine()
    link = ApiLink(engine, str(tmp_path), lambda: CoreState(None, None), servers=2)
    for api, request_id in ((0, "a"), (0, "b"), (1, "c")):
        link._submit(api, request_id, [1], SamplingParams(max_tokens=2))
    engine.callbacks["b"](RequestOutput("b", "", [1], [], finished=True, finish_reason="length"))  # b is done
    link.forget(0)
    assert engine.aborted == ["a"]  # only process 0's unfinished request; process 1's "c" runs on
    link.forget(0)
    assert engine.aborted == ["a"]
    link.close()


def test_the_api_side_holds_stop_strings_back_until_min_tokens():
    from afd.engine.request import SamplingParams

    text = RequestText(Letters(), ("b",), SamplingParams(max_tokens=8, stop=("b",), min_tokens=3))
    steps = [RequestOutput("r", "", [t], [], completion_tokens=i + 1) for i, t in enumerate([1, 0, 1])]
    ended = [text.fill(o) for o in steps]  # "b" at the first token does not stop it; at the third it does
    assert ended == [False, False, True] and "".join(o.text for o in steps) == "ba"
