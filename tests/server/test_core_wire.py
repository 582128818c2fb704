"""The messages between the API process and the engine core, and the text the API makes from token ids."""

import contextlib
import pickle
import re
from dataclasses import astuple

import pytest

from afd.engine.request import RequestOutput, SamplingParams, TokenLogprobs
from afd.server.api_process import core_wire
from afd.server.api_process.core_wire import CoreState
from afd.server.api_process.request_text import RequestText


def test_a_submit_carries_every_sampling_parameter():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop=("a", "bc"),
                            stop_token_ids=(4,), ignore_eos=True, logprobs=2)
    assert core_wire.decode_request(core_wire.encode_submit(2, "r1", [1, 2, 3], params, 12.5, "g")) == (
        core_wire.SUBMIT, 2, "r1", [1, 2, 3], params, 12.5, "g", [])
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
    from afd.kv.cache import KVBlocks
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
        kind, api, request_id, prompt, params, arrival, _, carried = message
        assert (kind, api, request_id, prompt, params.max_tokens, carried) == (core_wire.SUBMIT, 0, request.request_id, [1, 2], 3, [])
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

    from afd.kv.cache import KVBlocks
    from afd.server.api_process.core_link import ApiLink
    from afd.server.api_process.engine_client import EngineClient

    class Echo:
        """An engine that answers every submit at once with one finished token, the prompt's first id."""

        on_burst = None

        def submit(self, prompt_ids, params, on_output, request_id, text, arrival, group, carried=()):
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

        def submit(self, prompt_ids, params, on_output, request_id, text, arrival, group=None, carried=()):
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


def test_a_batch_of_submits_arrives_as_sent():
    params = [SamplingParams(max_tokens=3, seed=5 + j, stop=("x",)) for j in range(3)]
    submits = [(f"r{j}", [1, 2, j], params[j], 7.5 + j, "g", [4, j] if j else []) for j in range(3)]
    assert core_wire.decode_request(core_wire.encode_submits(1, submits)) == (core_wire.SUBMITS, 1, submits)


def _pickled(value) -> bytes:
    return pickle.dumps(value)


_PARAMS = astuple(SamplingParams(max_tokens=3))  # as a submit carries them; max_tokens first


MALFORMED = [
    (b"\x80\x05garbage", "not a pickled message"),
    (_pickled(["submits", 0, []]), "not a request message"),
    (_pickled(("launch", 0)), "not a request message"),
    (_pickled(("submits", "0", [("r", [1], _PARAMS, 1.0, "g", [])])), "API process '0'"),
    (_pickled(("submits", 0, [])), "non-empty list of submits"),
    (_pickled(("submits", 0, ("r", [1], _PARAMS, 1.0, "g", []))), "non-empty list of submits"),
    (_pickled(("submits", 0, [("r", [1], _PARAMS, 1.0, "g", []), ("s", [1], _PARAMS)])), "submit 1 of a batch is not"),
    (_pickled(("submits", 0, [("r", [1, "2"], _PARAMS, 1.0, "g", [])])), "submit 0 of a batch (r) has prompt ids"),
    (_pickled(("submits", 0, [("r", [1], _PARAMS[:2], 1.0, "g", [])])), "not a tuple of"),
    (_pickled(("submits", 0, [("r", [1], (0,) + _PARAMS[1:], 1.0, "g", [])])), "max_tokens must be at least 1"),
    (_pickled(("submits", 0, [(5, [1], _PARAMS, 1.0, "g", [])])), "request id 5, not a string"),
    (_pickled(("submits", 0, [("r", [1], _PARAMS, "soon", "g", [])])), "arrival 'soon'"),
    (_pickled(("submit", 0, "r", [1], _PARAMS, 1.0)), "a submit message of 6 fields"),
    (_pickled(("submits", 0, [("r", [1], _PARAMS, 1.0, "g", [1, "2"])])), "has carried tokens"),
    (_pickled(("abort", 0, None)), "abort of request id None"),
    (_pickled(("beat", 0, "yes", None)), "a beat of"),
]


@pytest.mark.parametrize("message, says", MALFORMED, ids=[says for _, says in MALFORMED])
def test_a_malformed_request_message_is_refused_whole_saying_why(message, says):
    with pytest.raises(core_wire.BadMessage, match=re.escape(says)):
        core_wire.decode_request(message)


class Recording:
    """An engine that records each `together()` block's submits and answers each at once with one finished token;
    a prompt starting with 0 makes its submit fail as a bug would."""

    on_burst = None

    def __init__(self):
        self.blocks: list[list[str]] = []
        self.inside = None

    @contextlib.contextmanager
    def together(self):
        self.inside = []
        yield
        self.blocks.append(self.inside)
        self.inside = None

    def submit(self, prompt_ids, params, on_output, request_id, text, arrival, group, carried=()):
        if prompt_ids[0] == 0:
            raise RuntimeError("the engine broke")
        self.inside.append(request_id)
        on_output(RequestOutput(request_id, "", [prompt_ids[0]], [], finished=True, finish_reason="length"))
        self.on_burst()

    def abort(self, request_id):
        pass


def test_the_core_drops_a_garbage_batch_with_a_log_line_and_admits_a_good_one_together(tmp_path, caplog):
    """A batch it cannot read is dropped, the link thread goes on; a batch is one `together()` block; a submit the
    engine fails on is answered with an error and the rest of its batch is admitted."""
    import zmq

    from afd.server.api_process.core_link import ApiLink, addresses

    engine = Recording()
    link = ApiLink(engine, str(tmp_path), lambda: CoreState(None, None), beat_s=0.05).start()
    context = zmq.Context()
    requests, outputs = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    requests.connect(addresses(str(tmp_path))[0])
    outputs.connect(addresses(str(tmp_path))[1])
    params = SamplingParams(max_tokens=1)
    try:
        assert outputs.poll(10_000), "no beat from the link"  # connected: no output is sent before we listen
        requests.send(b"\x80\x05garbage")
        requests.send(_pickled(("submits", 0, [("a", [1], astuple(params), 1.0, "g", []), ("b", "oops", (), None, "g", [])])))
        requests.send(core_wire.encode_submits(0, [(rid, [first], params, 1.0, "g", [])
                                                   for rid, first in (("c", 3), ("d", 0), ("e", 4))]))
        answers = {}
        while len(answers) < 3:
            assert outputs.poll(10_000), "the link stopped answering"
            answers.update((o.request_id, o) for o in core_wire.decode_outputs(outputs.recv())[1])
    finally:
        requests.close(linger=0)
        outputs.close(linger=0)
        context.term()
        link.close()
    assert engine.blocks[-1] == ["c", "e"]  # one block: the batch's choices admitted together
    assert [answers[r].token_ids for r in "ce"] == [[3], [4]] and answers["d"].finish_reason == "error"
    assert answers["d"].error == "the engine core could not take the request: the engine broke"
    dropped = [r.getMessage() for r in caplog.records if "cannot read" in r.getMessage()]
    assert len(dropped) == 2
    assert dropped[0].startswith("a request message the core cannot read (9 bytes): dropped: not a pickled message")
    assert "dropped: submit 1 of a batch (b) has prompt ids 'oops', not a non-empty list of ints" in dropped[1]
    assert all("a" not in block for block in engine.blocks)  # nothing of the bad batch was admitted


class Sent:
    """The API process's request socket: records what it sends, or refuses everything as zmq does with no core."""

    def __init__(self, connected: bool):
        self.connected, self.messages = connected, []

    def send(self, message, flags=0):
        import zmq

        if not self.connected:
            raise zmq.Again()
        self.messages.append(core_wire.decode_request(message))

    def close(self):
        pass


def _client(tmp_path, connected: bool):
    from afd.kv.cache import KVBlocks
    from afd.server.api_process.engine_client import EngineClient

    client = EngineClient(str(tmp_path), Letters(), KVBlocks(8, 16), 4, 64, 128)
    client._requests.close(linger=0)
    client._requests = Sent(connected)
    return client


def test_the_choices_of_one_together_go_to_the_core_as_one_message(tmp_path):
    client = _client(tmp_path, connected=True)
    got: list = []
    with client.together():
        with client.together():  # nested: the outer block sends
            first = client.submit([1, 2], SamplingParams(max_tokens=2, seed=1), got.append, group="g")
        assert client._requests.messages == []  # nothing sent before the block ends
        dropped = client.submit([1, 2], SamplingParams(max_tokens=2, seed=2), got.append, group="g")
        client.abort(dropped.request_id)  # never sent: nothing to abort in the core
        last = client.submit([1, 2], SamplingParams(max_tokens=2, seed=3), got.append, group="g")
    lone = client.submit([3], SamplingParams(max_tokens=2), got.append)
    [batch, single] = client._requests.messages
    assert batch[:2] == (core_wire.SUBMITS, 0)
    assert [(rid, ids, p.seed, arrival, group) for rid, ids, p, arrival, group, _ in batch[2]] == [
        (first.request_id, [1, 2], 1, first.arrival, "g"), (last.request_id, [1, 2], 3, last.arrival, "g")]
    assert single == (core_wire.SUBMIT, 0, lone.request_id, [3], SamplingParams(max_tokens=2), lone.arrival, None, [])
    assert got == [] and client.num_waiting_here == 3
    client.close()


def test_a_batch_the_core_cannot_be_sent_fails_each_request_as_a_lone_submit_does(tmp_path):
    client = _client(tmp_path, connected=False)
    got: dict[int, list] = {j: [] for j in range(4)}
    with client.together():
        for j in range(3):
            client.submit([1, 2], SamplingParams(max_tokens=2, seed=j), got[j].append, group="g")
        assert all(not outputs for outputs in got.values())  # failed at the block's end, not before
    client.submit([1, 2], SamplingParams(max_tokens=2), got[3].append)
    assert all(len(outputs) == 1 for outputs in got.values()) and client.num_waiting_here == 0
    assert {(o.finished, o.finish_reason, o.error) for outputs in got.values() for o in outputs} == {
        (True, "error", "the engine core is not connected")}
    client.close()
