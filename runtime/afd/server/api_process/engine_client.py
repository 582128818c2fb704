"""What the API uses of the engine, in an API process (`AFD_API_PROCESS`): the core answers over zmq.

`submit`, `abort` and `problem` behave as `Engine`'s do for `afd.server.api.app`: a request the
engine could never run is refused here with the same `InvalidRequest` (the same scheduler
check, on the core's KV-cache blocks, `KVBlocks`); the submits of one `together()` (a prompt's choices)
go to the core as one message, so it admits them together and they share the prompt's prefill; outputs
arrive on the event loop, a burst per message, as token ids that get their text here (`request_text`).
The core's state comes with every message; a core silent for `silence_s` makes the rank
unhealthy and ends every request waiting on it with an error, so none waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Callable, Sequence

import zmq
import zmq.asyncio

from afd.engine.recovery.carry import carried_params, prime_text
from afd.engine.request import Request, RequestOutput, SamplingParams
from afd.engine.scheduling.scheduler import Scheduler
from afd.kv.cache import KVBlocks
from afd.server.api_process import core_wire
from afd.server.api_process.core_link import addresses
from afd.server.api_process.core_wire import CoreState
from afd.server.api_process.request_text import RequestText

log = logging.getLogger(__name__)

NOT_CONNECTED = "the engine core is not connected"


class EngineClient:
    """The engine core seen from the API process; `run()` (on the event loop) receives and heartbeats."""

    def __init__(self, folder: str, tokenizer, kv: KVBlocks, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, silence_s: float = 5.0, beat_s: float = 0.5, api: int = 0):
        self.tokenizer, self.silence_s, self.beat_s, self.api = tokenizer, silence_s, beat_s, api
        self._admission = Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len)
        requests, outputs = addresses(folder, api)
        self._context, self._async_context = zmq.Context(), zmq.asyncio.Context()
        self._requests = self._context.socket(zmq.PUSH)
        self._requests.setsockopt(zmq.SNDHWM, 0)
        self._requests.setsockopt(zmq.LINGER, 0)
        self._requests.connect(requests)
        self._outputs = self._async_context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.connect(outputs)
        self._waiting: dict[str, Callable[[RequestOutput], None]] = {}
        self._texts: dict[str, RequestText] = {}
        self.state = CoreState("the engine core has not answered yet", None)
        self.heard: float | None = None
        self._batch: list[tuple] | None = None  # the submits of the open `together()`, sent as one message at its end

    # -- what app.py uses of Engine (event loop) ----------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], None],
               group: str | None = None, carried: Sequence[int] = ()) -> Request:
        """Send a request to the core (inside `together()`: at its end); `InvalidRequest` if it can never run there.
        `group`, `carried` (a stream moved here from a lost rank: the tokens its client has): as `Engine.submit`'s;
        the text of the carried tokens is replayed here, where the text is made."""
        sampling = carried_params(params, len(carried)) if carried else params
        request = self._admission.check(Request(list(prompt_ids) + list(carried), sampling, on_output))
        self._waiting[request.request_id] = on_output
        text = self._texts[request.request_id] = RequestText(self.tokenizer, params.stop, params)
        if carried:
            prime_text(text.detokenizer, text.checker, carried)
        submit = (request.request_id, list(prompt_ids), params, request.arrival, group, list(carried))
        if self._batch is not None:
            self._batch.append(submit)
        elif not self._send(core_wire.encode_submit(self.api, *submit)):
            self._fail(request.request_id, NOT_CONNECTED)
        return request

    @contextlib.contextmanager
    def together(self):
        """As `Engine.together`: the requests submitted inside reach the core as one message at the end (also when
        the block raises: the caller aborts what it submitted), which the core admits at once (`core_link`); if it
        cannot be sent, each of them fails as a lone submit does. Nested blocks send at the outermost's end."""
        if self._batch is not None:
            yield
            return
        self._batch = []
        try:
            yield
        finally:
            batch, self._batch = self._batch, None
            if batch and not self._send(core_wire.encode_submits(self.api, batch)):
                for request_id, *_ in batch:
                    self._fail(request_id, NOT_CONNECTED)

    def abort(self, request_id: str) -> None:
        self._texts.pop(request_id, None)
        if self._waiting.pop(request_id, None) is None:
            return
        if self._batch is not None and any(submit[0] == request_id for submit in self._batch):
            self._batch = [submit for submit in self._batch if submit[0] != request_id]  # never sent: nothing to stop
        else:
            self._send(core_wire.encode_abort(self.api, request_id))

    @property
    def problem(self) -> str | None:
        """Why the core cannot serve (its own word, or its silence), or None."""
        if self.heard is None:
            return self.state.problem
        silent = time.monotonic() - self.heard
        if silent > self.silence_s:
            return f"the engine core has been silent for {silent:.0f} s"
        return self.state.problem

    def unready(self) -> str | None:
        """Why the rank is not ready (its readiness probe's reason), or None: connections then close."""
        return self.problem or self.state.unready

    @property
    def num_waiting_here(self) -> int:
        """Requests sent to the core and not finished (tests, logs)."""
        return len(self._waiting)

    # -- event loop ------------------------------------------------------------------------------
    async def run(self, listening: Callable[[], bool], loop_problem: Callable[[], str | None]) -> None:
        """Receive the core's messages and heartbeat to it, until cancelled."""
        beats = asyncio.create_task(self._beat(listening, loop_problem))
        try:
            while True:
                self._take(await self._outputs.recv())
        finally:
            beats.cancel()

    def close(self) -> None:
        self._requests.close()
        self._outputs.close()
        self._context.term()
        self._async_context.term()

    def _take(self, message: bytes) -> None:
        state, outputs = core_wire.decode_outputs(message)
        self.state, self.heard = state, time.monotonic()
        waiting, texts = self._waiting, self._texts
        for output in outputs:
            request_id = output.request_id
            on_output = waiting.get(request_id)
            if on_output is None:  # aborted or stopped here: the core drops it at its next step
                continue
            if output.error is None and texts[request_id].fill(output):  # a stop string
                self._send(core_wire.encode_abort(self.api, request_id))
            if output.finished:
                del waiting[request_id], texts[request_id]
            on_output(output)

    async def _beat(self, listening: Callable[[], bool], loop_problem: Callable[[], str | None]) -> None:
        while True:
            self._send(core_wire.encode_beat(self.api, listening(), loop_problem()))
            if self._waiting and self.heard is not None and time.monotonic() - self.heard > self.silence_s:
                log.error("the engine core has been silent for %.0f s: failing %d requests", time.monotonic() - self.heard,
                          len(self._waiting))
                for request_id in list(self._waiting):
                    self._fail(request_id, self.problem)
                    self._send(core_wire.encode_abort(self.api, request_id))  # should the core come back
            await asyncio.sleep(self.beat_s)

    def _send(self, message: bytes) -> bool:
        try:
            self._requests.send(message, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _fail(self, request_id: str, message: str) -> None:
        self._texts.pop(request_id, None)
        on_output = self._waiting.pop(request_id, None)
        if on_output is not None:
            on_output(RequestOutput(request_id, "", [], [], finished=True, finish_reason="error", error=message))
