"""The output side of the engine: detokenize, find stop conditions, deliver each step's deltas.

The engine thread hands over each step's sampled tokens (already on the host) in one
call; with `threaded=True` the per-request work (incremental detokenization, stop
strings, EOS, callbacks) runs on its own thread, so it overlaps the next device step.
A request it ends early (EOS, stop token or stop string) is reported back through
`on_stopped`, and the engine frees it at its next iteration; tokens of steps already
launched for it are dropped here. Length limits are known to the engine in advance.
Errors go through the same queue, so a request's outputs keep their order.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from afd.engine.request import Request, RequestOutput

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, eos_token_ids: set[int], max_model_len: int, observer, on_stopped: Callable[[Request], None],
                 threaded: bool):
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.observer, self.on_stopped = observer, on_stopped
        self.on_burst: Callable[[], None] | None = None  # after each step's outputs (or errors): one flush per burst
        self._queue: queue.SimpleQueue | None = queue.SimpleQueue() if threaded else None
        self._thread = threading.Thread(target=self._drain, name="engine-outputs", daemon=True) if threaded else None
        if self._thread is not None:
            self._thread.start()

    # -- engine thread ---------------------------------------------------------
    def tokens(self, batch: list[Request], tokens: list[int], logprobs: list, now: float) -> None:
        """One step's results: row i of `tokens` belongs to `batch[i]`."""
        self._put((self._deliver, batch, tokens, logprobs, now))

    def prompt_logprobs(self, entries: list) -> None:
        """One step's prompt logprobs: (request, its entries) pairs, delivered with each request's first token."""
        self._put((self._gather_prompt, entries))

    def fail(self, requests: list[Request], message: str) -> None:
        """End `requests` with an error output each (after every output already handed over)."""
        self._put((self._fail, requests, message))

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)

    def _put(self, item) -> None:
        if self._queue is None:
            self._run(item)
        else:
            self._queue.put(item)

    # -- output thread (or inline) ---------------------------------------------
    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            self._run(item)

    def _run(self, item) -> None:
        try:
            item[0](*item[1:])
            if self.on_burst is not None:
                self.on_burst()
        except Exception:  # noqa: BLE001 — never let one bad step stop every later output
            log.exception("output processing failed")

    @staticmethod
    def _gather_prompt(entries: list) -> None:
        for request, found in entries:
            request.prompt_logprobs.extend(found)

    def _deliver(self, batch: list[Request], tokens: list[int], logprobs: list, now: float) -> None:
        for request, token, token_logprobs in zip(batch, tokens, logprobs):
            if request.done:
                continue  # ended already (stop string, abort, error): this step ran ahead of that news
            try:
                self._advance(request, token, token_logprobs, now)
            except Exception as err:
                log.exception("request %s failed after sampling", request.request_id)
                self._fail([request], f"internal error: {type(err).__name__}: {err}")
                self.on_stopped(request)

    def _advance(self, request: Request, token: int, token_logprobs, now: float) -> None:
        if self.observer:
            self.observer.on_token(request, now)
        request.first_token_at = request.first_token_at or now
        request.last_token_at = now
        request.output_ids.append(token)
        params, checker = request.params, request.stop_checker
        reason = stopped = None
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            reason = stopped = "stop"
        else:
            if checker is not None:  # None: the caller makes the text (the API process, `afd.server.api_process.request_text`)
                checker.add(request.detokenizer.add(token), look=len(request.output_ids) >= params.min_tokens)
            if checker is not None and checker.stopped:
                reason = stopped = "stop"
            elif len(request.output_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
                reason = "length"
        request.done = reason is not None
        request.on_output(RequestOutput(
            request.request_id, checker.take(final=request.done) if checker is not None else "", [token],
            [token_logprobs] if token_logprobs else [],
            finished=request.done, finish_reason=reason,
            prompt_tokens=len(request.prompt_ids) - request.carried, completion_tokens=len(request.output_ids) + request.carried,
            prompt_logprobs=[None, *request.prompt_logprobs] if (
                params.prompt_logprobs is not None and len(request.output_ids) == 1) else None,
            cached_tokens=min((request.shares or request).prefix_hit, len(request.prompt_ids) - request.carried),
        ))
        if stopped:
            self.on_stopped(request)

    def _fail(self, requests: list[Request], message: str) -> None:
        for request in requests:
            if request.done:
                continue
            request.done = True
            if self.observer:
                self.observer.on_error()
            try:
                request.on_output(RequestOutput(request.request_id, "", [], [], finished=True, finish_reason="error",
                                                error=message))
            except Exception:
                log.exception("could not deliver the error of %s", request.request_id)
