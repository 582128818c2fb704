"""The streaming output path's shortcuts give exactly what the plain path gave (pure, no server)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import pytest

from afd.engine.request import RequestOutput, TokenLogprobs
from afd.engine.text.detokenizer import IncrementalDetokenizer
from afd.engine.text.tokenizer import load_tokenizer, text_decoder
from afd.server.api.formatting import chat_chunk, completion_chunk
from afd.server.api.handoff import LoopHandoff, OutputSink
from afd.server.api.sse import StreamEvents

TEXTS = ["", "plain", ' "quoted" \\ back', "line\nbreak\ttab\x01", "é 漢字 🙂", "\ud800 lone surrogate"]


@pytest.fixture
def frozen_clock(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.7)


@pytest.mark.parametrize("model", ["tiny", 'mödel "x"'])
def test_stream_events_are_the_bytes_json_dumps_gave(frozen_clock, model):
    state = SimpleNamespace(model_name=model, tokenizer=None)
    completions = StreamEvents(state, "abc123", "text_completion")
    chats = StreamEvents(state, "abc123", "chat.completion.chunk")
    for text in TEXTS:
        for reason in (None, "stop", "length"):
            output = RequestOutput("abc123", text, [7], [], finished=reason is not None, finish_reason=reason)
            for prefix, index in (("", 0), ("echo: é", 0), ("", 3)):
                expected = f"data: {json.dumps(completion_chunk(state, 'abc123', output, prefix, index))}\n\n"
                assert completions.completion(output, prefix, index) == expected
            for first, index in ((True, 0), (False, 0), (True, 2)):
                expected = f"data: {json.dumps(chat_chunk(state, 'abc123', output, first, index))}\n\n"
                assert chats.chat(output, first, index) == expected


def test_stream_events_with_logprobs_keep_their_logprobs(frozen_clock, checkpoints):
    state = SimpleNamespace(model_name="tiny", tokenizer=load_tokenizer(str(checkpoints["qwen3_moe"])))
    output = RequestOutput("r", "hi", [7], [TokenLogprobs(7, -0.5, [(7, -0.5), (9, -1.5)])])
    event = StreamEvents(state, "r", "text_completion").completion(output, "")
    assert json.loads(event[len("data: "):])["choices"][0]["logprobs"]["token_logprobs"] == [-0.5]
    event = StreamEvents(state, "r", "chat.completion.chunk").chat(output, True)
    assert len(json.loads(event[len("data: "):])["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


def test_text_decoder_gives_the_tokenizers_text(checkpoints):
    tokenizer = load_tokenizer(str(checkpoints["qwen3_moe"]))
    decode = text_decoder(tokenizer)
    ids = tokenizer.encode("Hello wörld, 漢字 and 🙂!") + [0, 1, 2] + list(range(3, 300, 7))
    for start in range(0, len(ids), 3):
        for end in range(start, min(len(ids), start + 6) + 1):
            assert decode(ids[start:end]) == tokenizer.decode(ids[start:end], skip_special_tokens=True)


def test_streamed_text_is_the_whole_text(checkpoints):
    tokenizer = load_tokenizer(str(checkpoints["qwen3_moe"]))
    ids = tokenizer.encode("Hello wörld, 漢字 and 🙂 again 🙂🙂!") + [0] + tokenizer.encode(" tail")
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert "".join(detokenizer.add(i) for i in ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_changes_decoding_keeps_its_text(checkpoints):
    base = load_tokenizer(str(checkpoints["qwen3_moe"]))

    class Shouting(type(base)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting.from_pretrained(str(checkpoints["qwen3_moe"]))
    ids = shouting.encode("quiet words")
    assert text_decoder(shouting)(ids) == "QUIET WORDS"


def test_a_burst_of_outputs_wakes_the_loop_once_and_keeps_each_requests_order():
    async def scenario():
        loop = asyncio.get_running_loop()
        handoff, sinks = LoopHandoff(loop), [OutputSink() for _ in range(3)]
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))[1]

        def engine_step():  # one step's outputs, all handed over before the loop runs again
            for token in range(20):
                for index, sink in enumerate(sinks):
                    handoff.put(sink, RequestOutput(f"r{index}", str(token), [token], []))

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()  # the loop has not run meanwhile: one burst
        taken = [await sink.take() for sink in sinks]
        return wakeups, taken

    wakeups, taken = asyncio.run(scenario())
    assert len(wakeups) == 1
    assert [[o.token_ids[0] for o in outputs] for outputs in taken] == [list(range(20))] * 3


def test_a_sink_waits_for_its_next_output():
    async def scenario():
        loop = asyncio.get_running_loop()
        handoff, sink = LoopHandoff(loop), OutputSink()
        waiting = asyncio.ensure_future(sink.take())
        await asyncio.sleep(0)
        assert not waiting.done()
        threading.Thread(target=handoff.put, args=(sink, RequestOutput("r", "x", [1], [], finished=True))).start()
        return await asyncio.wait_for(waiting, 5)

    assert [o.text for o in asyncio.run(scenario())] == ["x"]
