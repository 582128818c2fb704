"""The engine core's end of the link to the API process (`AFD_API_PROCESS`).

One thread takes the API's submits, aborts and heartbeats and hands them to the engine (token
ids only: the API makes the text, `request_text`). The engine's output thread collects each step's outputs here and, when the step's burst ends
(`Engine.on_burst`), sends them in one message with the core's state; when idle the thread
sends the state alone every `beat_s`. A request the engine refuses or cannot take ends with
an error output, so the API never waits for an answer that will not come.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import zmq

from afd.engine.request import InvalidRequest, RequestOutput
from afd.server import core_wire
from afd.server.core_wire import CoreState

log = logging.getLogger(__name__)


def addresses(folder: str) -> tuple[str, str]:
    """(requests, outputs) endpoints of the link in `folder`, a private directory of the pod."""
    return f"ipc://{folder}/requests", f"ipc://{folder}/outputs"


class ApiLink:
    """Binds the link in `folder`; `state()` (any thread) is what each message says about the core."""

    def __init__(self, engine, folder: str, state: Callable[[], CoreState], beat_s: float = 0.5, stall_s: float = 10.0):
        self.engine, self.state, self.beat_s, self.stall_s = engine, state, beat_s, stall_s
        self._context = zmq.Context()
        requests, outputs = addresses(folder)
        self._requests = self._context.socket(zmq.PULL)
        self._requests.setsockopt(zmq.RCVHWM, 0)
        self._requests.bind(requests)
        self._outputs = self._context.socket(zmq.PUSH)
        self._outputs.setsockopt(zmq.SNDHWM, 0)  # a stalled API is found by its heartbeats, not by blocking the engine
        self._outputs.setsockopt(zmq.LINGER, 0)
        self._outputs.bind(outputs)
        self._lock = threading.Lock()  # the pending outputs and the output socket
        self._pending: list[RequestOutput] = []
        self._sent = 0.0
        self._closed = threading.Event()
        self.listening = False  # the API process's HTTP server has started
        self.heard: float | None = None  # monotonic time of the API's last heartbeat
        self._api_loop_problem: str | None = None
        self._thread = threading.Thread(target=self._serve, name="api-link", daemon=True)
        engine.on_burst = self.flush

    def start(self) -> "ApiLink":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        with self._lock:
            self._outputs.close()
        self._requests.close()
        self._context.term()

    def problem(self) -> str | None:
        """Why the API process cannot serve (silent, or its event loop stalled), or None (any thread)."""
        if self.heard is None:
            return None  # not started yet: readiness waits for `listening`
        silent = time.monotonic() - self.heard
        if silent > self.stall_s:
            return f"the API process has not reported for {silent:.0f} s (stalled or gone)"
        return self._api_loop_problem

    # -- output thread (and this link's thread) ----------------------------------------------
    def on_output(self, output: RequestOutput) -> None:
        with self._lock:
            self._pending.append(output)

    def flush(self) -> None:
        """Send what is pending, with the core's state, as one message."""
        state = self.state()
        with self._lock:
            pending, self._pending = self._pending, []
            if self._outputs.closed:
                return
            try:
                self._outputs.send(core_wire.encode_outputs(state, pending), zmq.NOBLOCK)
            except zmq.Again:  # no API process connected (not started yet, or gone: the core exits)
                if pending:
                    log.error("no API process to deliver %d outputs to", len(pending))
            self._sent = time.monotonic()

    # -- link thread ---------------------------------------------------------------------------
    def _serve(self) -> None:
        poll_ms = int(self.beat_s * 1000 / 2)
        while not self._closed.is_set():
            try:
                if self._requests.poll(poll_ms):
                    self._take_requests()
                if self._pending or time.monotonic() - self._sent >= self.beat_s:
                    self.flush()
            except Exception:  # noqa: BLE001 — one bad message must not cut the API off the engine
                log.exception("the link to the API process failed to handle a message")

    def _take_requests(self) -> None:
        while True:
            try:
                message = self._requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, *rest = core_wire.decode_request(message)
            if kind == core_wire.SUBMIT:
                self._submit(*rest)
            elif kind == core_wire.ABORT:
                self.engine.abort(rest[0])
            elif kind == core_wire.BEAT:
                self.listening, self._api_loop_problem = rest
                self.heard = time.monotonic()

    def _submit(self, request_id: str, prompt_ids: list[int], params) -> None:
        try:
            self.engine.submit(prompt_ids, params, self.on_output, request_id=request_id, text=False)  # text: API side
        except InvalidRequest as err:  # the API checked it the same way: only a bug gets here
            self.on_output(RequestOutput(request_id, "", [], [], finished=True, finish_reason="error", error=str(err)))
