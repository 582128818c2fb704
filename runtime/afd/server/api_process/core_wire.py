"""The messages between the API process and the engine core (`AFD_API_PROCESS`), as plain tuples.

Both ends are processes of one pod, on ipc:// sockets in a private folder, so the encoding
is pickle of tuples of builtins: the cheapest to write and read in Python. An API process sends
one message per submit, abort or heartbeat, and the submits of one `together()` (a prompt's choices)
as one message, each naming the process (its index among the rank's `api_servers`); the core
reads each with `decode_request`, which refuses a malformed one whole (`BadMessage`). The core
sends each API process one message per output burst (the outputs of its own requests in one
step), each carrying the core's state, and a heartbeat when idle.
"""

from __future__ import annotations

import pickle
from dataclasses import astuple, dataclass, fields

from afd.engine.request import RequestOutput, SamplingParams, TokenLogprobs

VERSION = 3  # 2: outputs carry prompt logprobs; 3: and cached prompt tokens
SUBMIT, SUBMITS, ABORT, BEAT = "submit", "submits", "abort", "beat"


class BadMessage(ValueError):
    """A request message the core cannot read (not this link's, or from another build): it is dropped whole."""


@dataclass(frozen=True)
class CoreState:
    """What the core says about itself in every message: why it cannot serve (None: it can), and
    why the rank is not ready (draining, FFN about to stop; None: ready)."""

    problem: str | None
    unready: str | None


def encode_submit(api: int, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float,
                  group: str | None = None, carried: list[int] | None = None) -> bytes:
    """`arrival`: `time.monotonic()` when the API process took the request (one clock for the pod's processes on
    Linux), so the core's time to first token counts from there, as in one process; `group`: the choices of one
    prompt share its prefill (`Engine.submit`); `carried`: the output tokens a stream moved from a lost rank already
    sent its client (`Engine.submit`)."""
    return pickle.dumps((SUBMIT, api, request_id, prompt_ids, astuple(params), arrival, group, list(carried or [])),
                        protocol=pickle.HIGHEST_PROTOCOL)


def encode_submits(api: int, submits: list[tuple]) -> bytes:
    """Several submits as one message, admitted by the core together (the choices of one prompt share its prefill
    however the core's polls fall); each submit is (request id, prompt ids, params, arrival, group, carried), as in
    `encode_submit`."""
    rows = [(request_id, prompt_ids, astuple(params), arrival, group, list(carried))
            for request_id, prompt_ids, params, arrival, group, carried in submits]
    return pickle.dumps((SUBMITS, api, rows), protocol=pickle.HIGHEST_PROTOCOL)


def encode_abort(api: int, request_id: str) -> bytes:
    return pickle.dumps((ABORT, api, request_id), protocol=pickle.HIGHEST_PROTOCOL)


def encode_beat(api: int, listening: bool, loop_problem: str | None) -> bytes:
    """API process `api` is alive: whether its HTTP server listens, and whether its event loop turns."""
    return pickle.dumps((BEAT, api, listening, loop_problem), protocol=pickle.HIGHEST_PROTOCOL)


def decode_request(message: bytes) -> tuple:
    """(SUBMIT, api, id, prompt ids, SamplingParams, arrival, group, carried) | (SUBMITS, api, [(id, prompt ids,
    SamplingParams, arrival, group, carried), ...]) | (ABORT, api, id) | (BEAT, api, listening, loop problem);
    `BadMessage` saying what is wrong if the message is not one of these (a batch is refused whole)."""
    try:
        decoded = pickle.loads(message)
    except Exception as err:  # noqa: BLE001 — whatever the bytes make pickle raise
        raise BadMessage(f"not a pickled message ({type(err).__name__}: {err})") from None
    if not isinstance(decoded, tuple) or len(decoded) < 2 or decoded[0] not in _LENGTHS:
        raise BadMessage(f"not a request message: {_shown(decoded)}")
    kind, api = decoded[0], decoded[1]
    if len(decoded) != _LENGTHS[kind] or not _is_int(api):
        raise BadMessage(f"a {kind} message of {len(decoded)} fields, API process {api!r}: {_shown(decoded)}")
    if kind == SUBMIT:
        return (kind, api, *_submit(decoded[2:]))
    if kind == SUBMITS:
        rows = decoded[2]
        if not isinstance(rows, list) or not rows:
            raise BadMessage(f"a submits message carries a non-empty list of submits, not {_shown(rows)}")
        return kind, api, [_submit(row, index) for index, row in enumerate(rows)]
    if kind == ABORT:
        if not isinstance(decoded[2], str):
            raise BadMessage(f"an abort of request id {_shown(decoded[2])}, not a string")
        return decoded
    if not isinstance(decoded[2], bool) or not (decoded[3] is None or isinstance(decoded[3], str)):
        raise BadMessage(f"a beat of (listening, loop problem) {_shown(decoded[2:])}, not (bool, str or None)")
    return decoded


_LENGTHS = {SUBMIT: 8, SUBMITS: 3, ABORT: 3, BEAT: 4}  # fields of each kind of request message
_PARAM_FIELDS = len(fields(SamplingParams))


def _submit(row, index: int | None = None) -> tuple:
    """One submit's (id, prompt ids, SamplingParams, arrival, group, carried), checked; `index`: its place in a
    batch."""
    where = "a submit" if index is None else f"submit {index} of a batch"
    if not isinstance(row, tuple) or len(row) != 6:
        raise BadMessage(f"{where} is not (id, prompt ids, params, arrival, group, carried): {_shown(row)}")
    request_id, prompt_ids, params, arrival, group, carried = row
    if not isinstance(request_id, str):
        raise BadMessage(f"{where} has request id {_shown(request_id)}, not a string")
    if not isinstance(prompt_ids, list) or not prompt_ids or set(map(type, prompt_ids)) != {int}:
        raise BadMessage(f"{where} ({request_id}) has prompt ids {_shown(prompt_ids)}, not a non-empty list of ints")
    if not (arrival is None or isinstance(arrival, (int, float)) and not isinstance(arrival, bool)):
        raise BadMessage(f"{where} ({request_id}) has arrival {_shown(arrival)}, not a time")
    if not (group is None or isinstance(group, str)):
        raise BadMessage(f"{where} ({request_id}) has group {_shown(group)}, not a string or None")
    if not isinstance(carried, list) or (carried and set(map(type, carried)) != {int}):
        raise BadMessage(f"{where} ({request_id}) has carried tokens {_shown(carried)}, not a list of ints")
    if not isinstance(params, tuple) or len(params) != _PARAM_FIELDS:
        raise BadMessage(f"{where} ({request_id}) has sampling parameters {_shown(params)}, not a tuple of "
                         f"{_PARAM_FIELDS} (both processes must come from one image)")
    try:
        sampling = SamplingParams(*params)
    except (TypeError, ValueError) as err:  # another build's fields, or values no API process sends
        raise BadMessage(f"{where} ({request_id}) has sampling parameters this core cannot read: {err}") from None
    return request_id, prompt_ids, sampling, arrival, group, carried


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value) -> str:
    """`value` for a log line, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def encode_outputs(state: CoreState, outputs: list[RequestOutput]) -> bytes:
    rows = [(o.request_id, o.text, o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs] if o.logprobs
             else None, o.finished, o.finish_reason, o.error, o.prompt_tokens, o.completion_tokens,
             None if o.prompt_logprobs is None else [None if lp is None else astuple(lp) for lp in o.prompt_logprobs],
             o.cached_tokens)
            for o in outputs]
    return pickle.dumps((VERSION, state.problem, state.unready, rows), protocol=pickle.HIGHEST_PROTOCOL)


def decode_outputs(message: bytes) -> tuple[CoreState, list[RequestOutput]]:
    version, problem, unready, rows = pickle.loads(message)
    if version != VERSION:
        raise ValueError(f"engine core message version {version}, this API process reads {VERSION}: "
                         "both processes must come from one image")
    outputs = [RequestOutput(rid, text, ids, [TokenLogprobs(*lp) for lp in lps] if lps else [], finished, reason, error,
                             prompt, completion,
                             None if shown is None else [None if lp is None else TokenLogprobs(*lp) for lp in shown], cached)
               for rid, text, ids, lps, finished, reason, error, prompt, completion, shown, cached in rows]
    return CoreState(problem, unready), outputs
