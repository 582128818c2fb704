"""The engine thread: admit requests, run one step over the batch, sample, stream the results.

Callers (the HTTP server) submit requests from any thread and get `RequestOutput` deltas
through a callback. With `pipeline` (the default) the loop runs one step ahead: step N+1 is
scheduled, built and launched (inputs from step N's sampled tokens on the device) before the
host waits for step N (on the FFN link, which notices a lost peer) and reads its tokens;
detokenization, stop strings and callbacks run on the output thread (`afd.engine.outputs`).
A request that stops early (EOS, stop string) may so run one step more, whose token is
dropped. The step function is the attention runner (remote FFN) or the monolithic model. A
step failing because the FFN peer is gone ends every request in flight with an explicit
error until the link is back (`afd.engine.recovery.link_care`), unless `hold_s` > 0: then the lost
steps are taken back and every request is held while the link re-handshakes (`afd.engine.recovery.hold`);
any other exception fails only the requests it touched; if the thread dies anyway, `problem` says
so and the rank turns unhealthy.
With `prefix_caching`, the full prompt blocks of a step are published for later prompts once its tokens are read
(`afd.engine.scheduling.prefix_hits`): a step taken back or failed never publishes.
With `prefill_itl_ratio`, every step's own duration (`StepClock`) teaches the scheduler's
`PrefillPacer` what a step costs (`afd.engine.scheduling.step_cost`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Sequence

import torch

from afd.engine.inputs import build_inputs, riders_of, to_device
from afd.engine.intake import new_request, prepare
from afd.engine.launched import Launched, run_step
from afd.engine.outputs import OutputProcessor
from afd.engine.recovery.hold import Hold
from afd.engine.recovery.link_care import LinkCare
from afd.engine.request import InvalidRequest, Request, RequestOutput, SamplingParams
from afd.engine.sampling.logits_controls import Controls
from afd.engine.sampling.prompt_logprobs import prompt_rows
from afd.engine.sampling.sampler import sample
from afd.engine.scheduling.scheduler import Scheduler
from afd.engine.scheduling.shared_prompt import copy_tails
from afd.engine.scheduling.step_cost import BACKLOG_STEPS, PrefillPacer, StepClock
from afd.engine.structured_output.grammars import Grammars
from afd.engine.structured_output.step_mask import StepMask, consume_step, step_mask
from afd.kv.cache import KVCache
from afd.step.layout import SeqLayout

log = logging.getLogger(__name__)
Step = Callable[[torch.Tensor, SeqLayout], torch.Tensor]


class Engine:
    """Continuous-batching generation loop of one attention rank."""

    def __init__(self, step: Step, kv_cache: KVCache, tokenizer, eos_token_ids: Sequence[int], max_num_seqs: int,
                 max_model_len: int, max_num_batched_tokens: int = 8192, device: torch.device | str = "cpu",
                 observer=None, link=None, link_check_s: float = 0.5, pipeline: bool = True,
                 on_logits: Callable[[list[Request], torch.Tensor], None] | None = None,
                 prefill_itl_ratio: float = 0.0, prefill_backlog_steps: int = BACKLOG_STEPS,
                 vocab_size: int | None = None, hold_s: float = 0.0, prefix_caching: bool = False):
        self.step = step
        self.kv_cache = kv_cache
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        pacer = PrefillPacer(prefill_itl_ratio, backlog_steps=prefill_backlog_steps) if prefill_itl_ratio else None
        self.scheduler = Scheduler(kv_cache, max_num_seqs, max_num_batched_tokens, max_model_len, pacer, prefix_caching)
        self._clock = StepClock()
        self.observer = observer
        self.link = link  # the FFN link: end_step/wait_step per step, tended between steps; None when local
        self.link_check_s = link_check_s
        self._care = LinkCare(link, link_check_s)
        self.hold_s = hold_s  # a lost FFN: hold every request this long for it to come back (0: fail them at once)
        self._held = Hold(lambda: self.hold_s, observer, self._holding)  # and the launched steps it would take back
        self.dead: str | None = None  # the engine thread ended unexpectedly (not recoverable)
        self.pipeline = pipeline
        self.on_logits = on_logits  # sees each step's batch and logits (`afd generate --with-logits`)
        self._inbox: list[Request] = []
        self._aborts: set[str] = set()
        self._stopped_early: list[Request] = []  # ended by the output side (EOS, stop string, error)
        self._inflight: Launched | None = None
        self._step_id = 0
        self._prev_tokens = torch.empty(0, dtype=torch.long, device=self.device)
        self._copies: list = []  # (from block, to block, rows) to copy before the next step (`shared_prompt`)
        self._controls = Controls()  # device rows of requests with logits controls, made on first use
        spec = getattr(getattr(step, "model", None), "spec", None)  # a runner's model knows its vocabulary
        self.vocab_size = (vocab_size or getattr(spec, "vocab_size", None)  # the logits' width (grammar masks)
                           or (len(tokenizer) if hasattr(tokenizer, "__len__") else None))
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self._outputs = OutputProcessor(set(eos_token_ids), max_model_len, observer, self._on_stopped, threaded=pipeline)
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # -- public, any thread ----------------------------------------------------
    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=timeout_s)
        self._outputs.close(timeout_s)

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], None],
               request_id: str | None = None, text: bool = True, arrival: float | None = None,
               carried: Sequence[int] = (), group: str | None = None) -> Request:
        """Queue a request; `InvalidRequest` if it can never run here. `request_id`: the caller's id for it;
        `text=False`: outputs carry no text and stop strings are not looked for (the caller detokenizes);
        `arrival`: when the caller took it (`time.monotonic()`; default now), where its time to first token starts;
        `carried`: output tokens the client already has from another rank, continued from (`afd.engine.recovery.carry`);
        `group`: requests of one group with one prompt (a request's choices) share its prefill (`afd.engine.scheduling.shared_prompt`)."""
        request = new_request(prompt_ids, params, on_output, carried, group, request_id, arrival)
        if carried and self.observer is not None and hasattr(self.observer, "on_carried"):
            self.observer.on_carried()
        request = self.scheduler.check(request)
        if params.prompt_logprobs is not None and not hasattr(self.step, "logit_rows"):
            raise InvalidRequest("prompt logprobs are not available with this attention engine", "prompt_logprobs")
        prepare(request, params, carried, lambda: self.grammars, self.vocab_size, self.device,
                self.tokenizer if text else None)
        with self._wake:
            closed = self.dead or ("the server is shutting down" if self._stopped else None)
            if not closed:
                self._inbox.append(request)
                self._wake.notify()
        if closed:  # nobody would ever take it: answer at once instead of leaving the caller waiting
            on_output(RequestOutput(request.request_id, "", [], [], finished=True, finish_reason="error", error=closed))
        return request

    @contextlib.contextmanager
    def together(self):
        """Requests submitted inside are taken by the engine thread at once (a prompt's choices are admitted
        together, so they can share its prefill)."""
        with self._wake:
            yield

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its KV-cache blocks are freed at the next step."""
        with self._wake:
            self._aborts.add(request_id)
            self._wake.notify()

    @property
    def grammars(self) -> Grammars:
        """Structured outputs' grammar cache, made on first use (any thread)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammars

    @property
    def eos_token_ids(self) -> set[int]:
        return self._outputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self._outputs.eos_token_ids = set(ids)

    @property
    def pacer(self) -> PrefillPacer | None:
        """The scheduler's prefill pacer, taught by every step; None: prompts are not paced."""
        return self.scheduler.pacer

    @property
    def on_burst(self) -> Callable[[], None] | None:
        """Called on the output thread after each step's outputs (or errors) went out: a burst ends."""
        return self._outputs.on_burst

    @on_burst.setter
    def on_burst(self, callback: Callable[[], None] | None) -> None:
        self._outputs.on_burst = callback

    def _on_stopped(self, request: Request) -> None:
        """The output side ended `request` (any thread): it is freed at the next iteration."""
        with self._wake:
            self._stopped_early.append(request)
            self._wake.notify()

    @property
    def problem(self) -> str | None:
        """Why this engine cannot serve now, or None (any thread)."""
        if self.dead:
            return self.dead
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stopped:
            return "the engine thread is not running"
        return self.error

    @property
    def error(self) -> str | None:
        """Why the FFN link cannot serve now (recoverable), or None."""
        return self._care.error

    @property
    def reconnects(self) -> int:
        return self._care.reconnects

    @property
    def num_running(self) -> int:
        """Running requests not yet answered in full (one stopped by the output side is freed a step later)."""
        return sum(not r.done for r in list(self.scheduler.running))

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)

    @property
    def held_since(self) -> float | None:
        """Since when (`time.monotonic()`) requests wait for a lost FFN rank to come back; None: none wait."""
        return self._held.since

    # -- engine thread ---------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as err:  # noqa: BLE001 — whatever ends the thread is reported, not lost
            self.dead = f"the engine thread died: {type(err).__name__}: {err}"
            log.critical("%s", self.dead, exc_info=True)
            self._fail_all(self.dead)

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not (self._stopped or self._inbox or self._aborts or self._stopped_early or self._inflight
                           or self.scheduler.running or self.scheduler.waiting):
                    if not self._wake.wait(timeout=self.link_check_s if self.link else None):
                        break  # idle: time to look after the link
                if self._stopped:
                    break
                for request in self._inbox:
                    self.scheduler.add(request)
                self._inbox.clear()
                aborts, self._aborts = self._aborts, set()
                stopped, self._stopped_early = self._stopped_early, []
            for request in self.scheduler.abort(aborts):
                log.info("aborted %s", request.request_id)
            for request in stopped:
                self.scheduler.finish(request)
            if self.link is not None and self._care.due():
                self._drain()  # the link is looked after between steps, none in flight
                self._care.tend(self._idle)
            if self.error is not None:
                self._drain()
                if self._held.holds(self._rewind):
                    with self._wake:  # wait for the link's next check (aborts and the stop still wake the loop)
                        self._wake.wait(timeout=self.link_check_s)
                    continue
                self._fail_all(f"the server cannot take requests: {self.error}")
                continue
            if self._held.since is not None:
                self._held.resumed()
            try:
                batch = self.scheduler.schedule()
                launched = self._launch(batch) if batch else None
                self._drain()  # the previous step: it ran on the device while this one was scheduled and launched
                self._inflight = None if self.error else launched  # a link lost meanwhile failed its requests too
                if not self.pipeline:
                    self._drain()
            except Exception as err:  # a bug outside the step: fail what is in flight, keep serving
                log.exception("engine iteration failed")
                self._inflight = None
                self._fail_all(f"internal error in the engine: {type(err).__name__}: {err}")
                continue
            if not batch and self.scheduler.waiting and not self.scheduler.running:
                time.sleep(0.001)  # cannot happen with worst-case reservation; never spin hot
        self._drain()
        self._fail_all("the server is shutting down")

    def _idle(self) -> bool:
        with self._wake:
            return not (self._inbox or self.scheduler.running or self.scheduler.waiting)

    def _launch(self, batch: list[Request]) -> Launched | None:
        """Build the step's inputs (one pass over `batch`), run it, start sampling; None if it failed."""
        step_id = self._step_id + 1
        riders = riders_of(batch, self.scheduler.leaders)  # they may sample in this step, on their leader's prefill
        undo = self._held.launched(batch + riders if riders else batch, self._step_id, self._prev_tokens)
        inputs = build_inputs(batch, step_id, self._prev_tokens, self.max_model_len, self.device,
                              self.kv_cache.block_size, self.scheduler.leaders)
        input_ids, layout, emit, sampling = inputs.input_ids, inputs.layout, inputs.emit, inputs.sampling
        started = time.monotonic()
        # no controls, prompt logprobs or grammar: today's path
        plain = all(r.params.plain for r in batch) and all(r.params.plain for r in riders)
        rows = None if plain else prompt_rows(batch, layout)
        if riders:
            batch = batch + riders  # what fails if the step fails
        try:
            copy_tails(self.kv_cache, self._copies)  # riders' last prompt blocks, boarded in the previous step
            self._copies = inputs.copies
            logits, prompt = run_step(self.step, input_ids, layout, rows, self.device)
            if self.on_logits is not None:
                self.on_logits(batch, logits)
        except Exception as err:  # a lost FFN peer, or a bug: fail loudly, never hang
            log.exception("step failed")
            self._drain()  # the previous step's tokens, if it finished, are good: deliver them first
            if self.error is None:  # (else that drain found the link lost and failed everything)
                self._step_failed(batch, err)
            self._held.forget(undo)
            return None
        rows_in = len(layout.new_lens)  # rows of unfinished prompt chunks sample nothing; a leader's, once per rider
        if len(emit) != rows_in or inputs.boarded:
            logits = logits[to_device(emit, logits.device)]
        try:
            mask = None if plain else self._grammar_mask(sampling, logits.device)
            if self._held.taken_back(undo):  # the FFN was lost while that read the previous step
                return None
            controls = None if plain and not self._controls.held() else self._controls.for_step(
                sampling, logits, self._held.in_flight().union(self.scheduler.running), self.eos_token_ids)
            sampled = sample(logits, inputs.params, inputs.generators, controls, mask).to_host()
        except Exception as err:  # only this step's requests fail; the engine and the link stay up
            log.exception("sampling failed")
            self._drain()
            self._fail(batch, f"sampling failed: {type(err).__name__}: {err}")
            self._held.forget(undo)
            return None
        self._step_id, self._prev_tokens = step_id, sampled.tokens
        undo.controls, undo.chosen = controls, sampled.tokens
        mark = self.link.end_step() if self.link is not None else None
        return Launched(sampling, sampled, inputs.finals, inputs.num_tokens, inputs.prompt_tokens, started,
                         time.monotonic(), mark, prompt, mask is not None, inputs.written)

    def _grammar_mask(self, sampling: list[Request], device: torch.device) -> StepMask | None:
        """The grammar masks of this step's structured rows (None: there are none). Their matchers need the previous
        step's tokens first: that step is read now, while the device already runs this one."""
        if self._inflight is not None and any(r.grammar is not None for r in sampling):
            self._drain()
        return step_mask(sampling, self.vocab_size, self.eos_token_ids, device)

    def _drain(self) -> None:
        """Wait for the launched step (the link first: it notices a lost FFN) and hand its tokens to the output side."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            return
        wait_from = time.monotonic()
        if self.link is not None:
            try:
                self.link.wait_step(launched.mark)
            except Exception as err:
                log.error("waiting for step failed: %s", err)
                self._step_failed(launched.batch, err)
                return
        self._held.read()  # read (or failed below): never taken back
        try:
            launched.sampled.wait()
            waited = time.monotonic()
            tokens, logprobs = launched.sampled.result()
            prompt = launched.prompt.result() if launched.prompt is not None else None
        except Exception as err:
            log.exception("sampling failed")
            self._fail(launched.batch, f"sampling failed: {type(err).__name__}: {err}")
            return
        if launched.structured:
            consume_step(launched.batch, tokens)
        now = time.monotonic()
        self.scheduler.publish(launched.written)  # its prompt blocks are written for good: later prompts may share them
        for request in launched.finals:  # their last token is in: seats and blocks go back
            self.scheduler.finish(request)
        if prompt:
            self._outputs.prompt_logprobs(prompt)
        self._outputs.tokens(launched.batch, tokens, logprobs, now)
        if (pacer := self.scheduler.pacer) is not None:
            seconds = self._clock.done(launched.started, launched.launched, wait_from, waited)
            pacer.observe(launched.tokens, seconds, prompt=launched.prompt_tokens > 0)
        if self.observer:
            self.observer.on_step(self, launched.tokens, now - launched.started)

    def _step_failed(self, batch: list[Request], err: Exception) -> None:
        """With no link only `batch` fails; a lost FFN fails every request, and the link re-handshakes
        before the next step."""
        if self.link is None:
            self._fail(batch, f"the step failed: {type(err).__name__}: {err}")
            return
        self._care.lose(err)
        if self.hold_s > 0:
            self._rewind()
            return
        self._fail_all(f"the step failed: {err}")

    def _rewind(self) -> None:
        """The FFN was lost with steps unread: take them back and hold every request for its return."""
        self._inflight = None
        back = self._held.take_back(self.vocab_size, self.device)
        if back is not None:
            self._step_id, self._prev_tokens = back
            self.scheduler.taken_back()

    def _holding(self) -> int:
        with self._wake:
            return len(self.scheduler.running) + len(self.scheduler.waiting) + len(self._inbox)

    def _fail_all(self, message: str) -> None:
        with self._wake:
            inbox, self._inbox = self._inbox, []
        self._held.unread = []
        self._fail(list(self.scheduler.running) + list(self.scheduler.waiting) + inbox, message)

    def _fail(self, requests: list[Request], message: str) -> None:
        """Free `requests` and end each with an error output (after the outputs already handed over)."""
        for request in requests:
            self.scheduler.finish(request)
        self._outputs.fail(requests, message)
