"""The engine core's end of the link to its API processes (`AFD_API_PROCESS`, `AFD_API_SERVERS`).

One thread takes the API processes' submits (one message may carry a prompt's choices: admitted
together), aborts and heartbeats (one socket for all; a message it cannot read is dropped with a log
line) and hands them to the engine (token ids only: the API makes the text, `request_text`). The
engine's output thread collects each step's outputs here, by the API process that submitted each
request, and when the step's burst ends (`Engine.on_burst`) sends each API process its outputs in
one message with the core's state on that process's own socket; when idle, the thread sends each
the state alone every `beat_s`. A request the engine refuses or cannot take ends with an error
output, so no API process waits for an answer that will not come.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import zmq

from afd.engine.request import InvalidRequest, RequestOutput
from afd.server.api_process import core_wire
from afd.server.api_process.core_wire import CoreState

log = logging.getLogger(__name__)


def addresses(folder: str, api: int = 0) -> tuple[str, str]:
    """(requests of every API process, outputs of API process `api`) endpoints in `folder`, a private
    directory of the pod."""
    return f"ipc://{folder}/requests", f"ipc://{folder}/outputs-{api}"


class ApiLink:
    """Binds the link in `folder` for `servers` API processes; `state()` (any thread) is what each message
    says about the core."""

    def __init__(self, engine, folder: str, state: Callable[[], CoreState], servers: int = 1, beat_s: float = 0.5,
                 stall_s: float = 10.0):
        if servers < 1:  # nothing would serve HTTP, and the idle beat has no API process to time
            raise ValueError(f"the core link serves 1 or more API processes, got {servers}: a config with "
                             "api_children 0 runs the API in the engine's process (set api_process or api_servers > 1)")
        self.engine, self.state, self.beat_s, self.stall_s = engine, state, beat_s, stall_s
        self._context = zmq.Context()
        self._requests = self._context.socket(zmq.PULL)
        self._requests.setsockopt(zmq.RCVHWM, 0)
        self._requests.bind(addresses(folder)[0])
        self._outputs = []
        for api in range(servers):
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)  # a stalled API is found by its heartbeats, not by blocking the engine
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind(addresses(folder, api)[1])
            self._outputs.append(socket)
        self._lock = threading.Lock()  # the pending outputs and the output sockets
        self._pending: list[list[RequestOutput]] = [[] for _ in range(servers)]
        self._sent = [0.0] * servers
        self._closed = threading.Event()
        self._listening = [False] * servers  # each API process's HTTP server has started
        self._heard: list[float | None] = [None] * servers  # monotonic time of each one's last heartbeat
        self._loop_problems: list[str | None] = [None] * servers
        self._owned: list[set[str]] = [set() for _ in range(servers)]  # each API process's unfinished requests
        self._on_output = [self._collector(api) for api in range(servers)]
        self._thread = threading.Thread(target=self._serve, name="api-link", daemon=True)
        engine.on_burst = self.flush

    def start(self) -> "ApiLink":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._thread.ident is not None:  # started
            self._thread.join(5)
        with self._lock:
            for socket in self._outputs:
                socket.close()
        self._requests.close()
        self._context.term()

    @property
    def listening(self) -> bool:
        """Every API process's HTTP server has started."""
        return all(self._listening)

    @property
    def heard(self) -> float | None:
        """When the API process heard from longest ago last reported; None until every one has."""
        return None if None in self._heard else min(self._heard)

    def problem(self) -> str | None:
        """Why the API cannot serve (an API process silent, or its event loop stalled), or None (any thread)."""
        for api, heard in enumerate(self._heard):
            if heard is None:
                continue  # not started yet: readiness waits for `listening`
            silent = time.monotonic() - heard
            if silent > self.stall_s:
                return f"API process {api} has not reported for {silent:.0f} s (stalled or gone)"
        return next((problem for problem in self._loop_problems if problem), None)

    # -- output thread (and this link's thread) ----------------------------------------------
    def forget(self, api: int) -> None:
        """API process `api` is gone: abort its requests in the engine and wait for the next process at its socket."""
        with self._lock:
            owned = list(self._owned[api])
            self._owned[api].clear()
            self._pending[api].clear()
            self._heard[api], self._listening[api], self._loop_problems[api] = None, False, None
        for request_id in owned:
            self.engine.abort(request_id)
        if owned:
            log.warning("API process %d is gone: aborted its %d requests in the engine", api, len(owned))

    def _collector(self, api: int) -> Callable[[RequestOutput], None]:
        pending, owned = self._pending[api], self._owned[api]

        def on_output(output: RequestOutput) -> None:
            with self._lock:
                pending.append(output)
                if output.finished:
                    owned.discard(output.request_id)
        return on_output

    def flush(self) -> None:
        """Send each API process what is pending for it, with the core's state, as one message; an API process
        with nothing pending gets the state alone once `beat_s` passed since its last message."""
        state, now = self.state(), time.monotonic()
        with self._lock:
            for api, socket in enumerate(self._outputs):
                pending = self._pending[api]
                if (not pending and now - self._sent[api] < self.beat_s) or socket.closed:
                    continue
                message, pending[:] = core_wire.encode_outputs(state, pending), []
                try:
                    socket.send(message, zmq.NOBLOCK)
                except zmq.Again:  # the API process is not connected (not started yet, or gone: the core exits)
                    log.error("API process %d is not connected: an output message is lost", api)
                self._sent[api] = now

    # -- link thread ---------------------------------------------------------------------------
    def _serve(self) -> None:
        poll_ms = int(self.beat_s * 1000 / 2)
        while not self._closed.is_set():
            try:
                if self._requests.poll(poll_ms):
                    with self.engine.together():  # a burst's submits (one prompt's choices) are admitted together
                        self._take_requests()
                if any(self._pending) or time.monotonic() - min(self._sent) >= self.beat_s:
                    self.flush()
            except Exception:  # noqa: BLE001 — one bad message must not cut the API off the engine
                log.exception("the link to the API processes failed to handle a message")

    def _take_requests(self) -> None:
        while True:
            try:
                message = self._requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                kind, api, *rest = core_wire.decode_request(message)
            except core_wire.BadMessage as err:
                log.error("a request message the core cannot read (%d bytes): dropped: %s", len(message), err)
                continue
            if not 0 <= api < len(self._outputs):
                log.error("a message from API process %r, of %d: dropped", api, len(self._outputs))
            elif kind == core_wire.SUBMIT:
                self._submit(api, *rest)
            elif kind == core_wire.SUBMITS:  # one prompt's choices: admitted together (this poll's `together`)
                for submit in rest[0]:
                    self._submit(api, *submit)
            elif kind == core_wire.ABORT:
                self.engine.abort(rest[0])
                with self._lock:
                    self._owned[api].discard(rest[0])
            elif kind == core_wire.BEAT:
                self._listening[api], self._loop_problems[api] = rest
                self._heard[api] = time.monotonic()

    def _submit(self, api: int, request_id: str, prompt_ids: list[int], params, arrival: float | None = None,
                group: str | None = None, carried: list[int] | None = None) -> None:
        on_output = self._on_output[api]
        with self._lock:
            self._owned[api].add(request_id)
        try:
            self.engine.submit(prompt_ids, params, on_output, request_id=request_id, text=False,  # text: API side
                               arrival=arrival, group=group, carried=carried or ())
        except InvalidRequest as err:  # the API checked it the same way: only a bug gets here
            on_output(RequestOutput(request_id, "", [], [], finished=True, finish_reason="error", error=str(err)))
        except Exception as err:  # noqa: BLE001 — answered, and the rest of its batch still admitted
            log.exception("the engine could not take request %s", request_id)
            on_output(RequestOutput(request_id, "", [], [], finished=True, finish_reason="error",
                                    error=f"the engine core could not take the request: {err}"))
