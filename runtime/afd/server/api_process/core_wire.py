"""The messages between the API process and the engine core (`AFD_API_PROCESS`), as plain tuples.

Both ends are processes of one pod, on ipc:// sockets in a private folder, so the encoding
is pickle of tuples of builtins: the cheapest to write and read in Python. An API process sends
one message per submit, abort or heartbeat, each naming the process (its index among the rank's
`api_servers`); the core sends each API process one message per output burst (the outputs of
its own requests in one step), each carrying the core's state, and a heartbeat when idle.
"""

from __future__ import annotations

import pickle
from dataclasses import astuple, dataclass

from afd.engine.request import RequestOutput, SamplingParams, TokenLogprobs

VERSION = 2  # 2: outputs carry prompt logprobs
SUBMIT, ABORT, BEAT = "submit", "abort", "beat"


@dataclass(frozen=True)
class CoreState:
    """What the core says about itself in every message: why it cannot serve (None: it can), and
    why the rank is not ready (draining, FFN about to stop; None: ready)."""

    problem: str | None
    unready: str | None


def encode_submit(api: int, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float,
                  group: str | None = None) -> bytes:
    """`arrival`: `time.monotonic()` when the API process took the request (one clock for the pod's processes on
    Linux), so the core's time to first token counts from there, as in one process; `group`: the choices of one
    prompt share its prefill (`Engine.submit`)."""
    return pickle.dumps((SUBMIT, api, request_id, prompt_ids, astuple(params), arrival, group),
                        protocol=pickle.HIGHEST_PROTOCOL)


def encode_abort(api: int, request_id: str) -> bytes:
    return pickle.dumps((ABORT, api, request_id), protocol=pickle.HIGHEST_PROTOCOL)


def encode_beat(api: int, listening: bool, loop_problem: str | None) -> bytes:
    """API process `api` is alive: whether its HTTP server listens, and whether its event loop turns."""
    return pickle.dumps((BEAT, api, listening, loop_problem), protocol=pickle.HIGHEST_PROTOCOL)


def decode_request(message: bytes) -> tuple:
    """(SUBMIT, api, id, prompt ids, SamplingParams, arrival, group) | (ABORT, api, id) | (BEAT, api, listening, loop
    problem)."""
    decoded = pickle.loads(message)
    if decoded[0] == SUBMIT:
        kind, api, request_id, prompt_ids, params, arrival, group = decoded
        return kind, api, request_id, prompt_ids, SamplingParams(*params), arrival, group
    return decoded


def encode_outputs(state: CoreState, outputs: list[RequestOutput]) -> bytes:
    rows = [(o.request_id, o.text, o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs] if o.logprobs
             else None, o.finished, o.finish_reason, o.error, o.prompt_tokens, o.completion_tokens,
             None if o.prompt_logprobs is None else [None if lp is None else astuple(lp) for lp in o.prompt_logprobs])
            for o in outputs]
    return pickle.dumps((VERSION, state.problem, state.unready, rows), protocol=pickle.HIGHEST_PROTOCOL)


def decode_outputs(message: bytes) -> tuple[CoreState, list[RequestOutput]]:
    version, problem, unready, rows = pickle.loads(message)
    if version != VERSION:
        raise ValueError(f"engine core message version {version}, this API process reads {VERSION}: "
                         "both processes must come from one image")
    outputs = [RequestOutput(rid, text, ids, [TokenLogprobs(*lp) for lp in lps] if lps else [], finished, reason, error,
                             prompt, completion,
                             None if shown is None else [None if lp is None else TokenLogprobs(*lp) for lp in shown])
               for rid, text, ids, lps, finished, reason, error, prompt, completion, shown in rows]
    return CoreState(problem, unready), outputs
