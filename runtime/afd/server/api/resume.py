"""Moving a stream to another attention rank (issue 38): the internal resume header, and reading a relayed stream.

A relay (the front door of `afd up`, or a rank's failover relay) asks the rank for each event's token
ids (`x-afd-token-ids: 1`: the rank puts an SSE comment line `: afd-ids 12,34` in the event, which
clients ignore and the relay strips). When the rank dies mid-stream, the relay sends the same request
to another rank with `x-afd-resume`: the stream's id and the token ids its client already has, signed
with the deployment's group secret (HMAC-SHA256), so no outside client can make a rank continue a
made-up output. That rank prefills prompt + those tokens, re-emits none of them (no role chunk, no
echo), and streams the rest under the same id; its usage counts every token once.

A stream of `n` > 1 choices says n once (`: afd-choices n`) and each event's ids with its choice's index
(`: afd-ids 2:12,34`); its resume carries every choice's ids and which choices had their last event out:
the next rank continues each unfinished choice from its own tokens (its own seed stream) and leaves
the finished ones be.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import sys
from array import array
from dataclasses import dataclass

from afd.engine.request import InvalidRequest

RESUME_HEADER = "x-afd-resume"
IDS_HEADER = "x-afd-token-ids"
IDS_COMMENT = b": afd-ids "
CHOICES_COMMENT = b": afd-choices "  # a stream of n > 1 choices says n (its first event); its ids say their index
MAX_CARRIED = 2048  # token ids in one resume header (all choices): 11 KB, within the HTTP servers' 16 KB header limit
MAX_CHOICES = 128
_FINISHED = "~"  # before a choice's ids in a resume header: its last event went out (not continued)
_STREAM_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_PREFIXES = {"text_completion": "cmpl-", "chat.completion.chunk": "chatcmpl-"}


@dataclass(frozen=True)
class Resume:
    """A stream to continue: its id (as the client saw it) and the token ids the client already has (of choice 0;
    `more`: of choices 1.. of an n > 1 stream; `finished`: the indexes of choices whose last event went out)."""

    stream_id: str
    token_ids: tuple[int, ...]
    more: tuple[tuple[int, ...], ...] = ()
    finished: tuple[int, ...] = ()

    @property
    def choices(self) -> tuple[tuple[int, ...], ...]:
        """Each choice's token ids, by index."""
        return (self.token_ids, *self.more)

    def request_id(self, kind: str) -> str:
        """The engine request id that gives this stream id for events of `kind`."""
        prefix = _PREFIXES[kind]
        if not self.stream_id.startswith(prefix):
            raise InvalidRequest(f"the resumed stream id {self.stream_id[:64]!r} is not a {kind} id", RESUME_HEADER)
        return self.stream_id[len(prefix):]


def sign(key: bytes, resume: Resume) -> str:
    """The header value for `resume`: `stream id.token ids (int32 little-endian, base64url).MAC`, with one `.ids` per
    choice of an n > 1 stream (`~` before a finished choice's)."""
    packs = [(_FINISHED if index in resume.finished else "") + _pack(ids) for index, ids in enumerate(resume.choices)]
    payload = ".".join([resume.stream_id, *packs])
    return f"{payload}.{_mac(key, payload)}"


def _pack(token_ids) -> str:
    ids = array("i", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return base64.urlsafe_b64encode(ids.tobytes()).decode()


def _unpack(packed: str) -> array:
    ids = array("i")
    try:
        ids.frombytes(base64.b64decode(packed.encode(), altchars=b"-_", validate=True))
    except (ValueError, binascii.Error):
        raise InvalidRequest(f"{RESUME_HEADER} is not a valid resume", RESUME_HEADER) from None
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


def verify(key: bytes, value: str | None, vocab_size: int) -> Resume | None:
    """The resume a header value asks for (None without the header); `InvalidRequest` naming what is wrong."""
    if value is None:
        return None
    if not key:
        raise InvalidRequest(f"{RESUME_HEADER} is internal to a deployment and this rank has no group secret",
                             RESUME_HEADER)
    payload, _, mac = value.rpartition(".")
    if not hmac.compare_digest(mac.encode(), _mac(key, payload).encode()):
        raise InvalidRequest(f"{RESUME_HEADER} is not signed by this deployment's group secret", RESUME_HEADER)
    stream_id, *packs = payload.split(".")
    if not 1 <= len(packs) <= MAX_CHOICES:
        raise InvalidRequest(f"{RESUME_HEADER} is not a valid resume", RESUME_HEADER)
    finished = tuple(i for i, packed in enumerate(packs) if packed.startswith(_FINISHED))
    choices = [_unpack(packed.removeprefix(_FINISHED)) for packed in packs]
    carried = sum(map(len, choices))
    open_ = len(packs) - len(finished)
    if not _STREAM_ID.fullmatch(stream_id) or not 0 < carried <= MAX_CARRIED or not open_ or (
            len(packs) == 1 and finished):
        raise InvalidRequest(f"{RESUME_HEADER} needs a stream id, 1..{MAX_CARRIED} token ids and a choice to continue",
                             RESUME_HEADER)
    if any(not 0 <= t < vocab_size for ids in choices for t in ids):
        raise InvalidRequest(f"{RESUME_HEADER} holds a token id outside the vocabulary", RESUME_HEADER)
    return Resume(stream_id, tuple(choices[0]), tuple(tuple(ids) for ids in choices[1:]), finished)


def _mac(key: bytes, payload: str) -> str:
    return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


def ids_comment(token_ids: list[int], index: int | None = None) -> str:
    """The comment line a rank puts in an event for a relay that asked for token ids (`index`: the event's choice, in
    a stream of n > 1 choices)."""
    ids = ",".join(map(str, token_ids))
    return f": afd-ids {ids}\n" if index is None else f": afd-ids {index}:{ids}\n"


def choices_comment(n: int) -> str:
    """The comment line a rank puts in the first event of a stream of `n` > 1 choices for a relay that asked for ids
    (its events' ids then say their choice's index)."""
    return f": afd-choices {n}\n"


class StreamReader:
    """What of a relayed SSE stream reached the client: whole events only, id comments stripped and gathered."""

    def __init__(self):
        self._pending = b""
        self.stream_id: str | None = None
        self.ids: dict[int, list[int]] = {}  # each choice's token ids that went out, by index
        self.done = False  # [DONE] went out: nothing to resume
        self.failed = False  # an error event went out: the rank's own answer, not resumed either
        self.events = 0  # data events that went out
        self.choices = 1  # the stream's choices (n), as its rank said
        self.finished_choices: set[int] = set()  # indexes of the choices whose last event went out

    def feed(self, chunk: bytes) -> bytes:
        """The complete events in `chunk` (with what was pending), ready for the client."""
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        self._pending = data[end + 2:]
        out = []
        for event in data[: end].split(b"\n\n"):
            lines = []
            for line in event.split(b"\n"):
                if line.startswith(IDS_COMMENT):
                    index, _, ids = line[len(IDS_COMMENT):].rpartition(b":")
                    self.ids.setdefault(int(index or 0), []).extend(int(t) for t in ids.split(b",") if t)
                    continue
                if line.startswith(CHOICES_COMMENT):
                    self.choices = max(1, int(line[len(CHOICES_COMMENT):]))
                    continue
                if line.startswith(b"data: "):
                    self._look(line[6:])
                lines.append(line)
            if lines:
                out.append(b"\n".join(lines) + b"\n\n")
        return b"".join(out)

    def _look(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        self.events += 1
        if data.startswith(b'{"error"'):
            self.failed = True
            return
        ended = b'"finish_reason": "' in data
        if self.stream_id is None or ended:
            chunk = json.loads(data)
            self.stream_id = self.stream_id or chunk.get("id")
            if ended:
                self.finished_choices.update(c.get("index", 0) for c in chunk.get("choices", ())
                                             if c.get("finish_reason"))

    @property
    def token_ids(self) -> list[int]:
        """Choice 0's token ids that went out."""
        return self.ids.get(0, [])

    @property
    def finished(self) -> bool:
        """Every choice's last event went out: only [DONE] (and usage) can be missing."""
        return len(self.finished_choices) >= self.choices

    def drop_partial(self) -> None:
        """Forget a cut event's first bytes (the client never got them)."""
        self._pending = b""

    @property
    def resumable(self) -> bool:
        """Cut before its end (not by an error event, not after its last token), and either nothing went out yet or
        the token ids of what did are known (a rank that does not say them, e.g. vLLM's, cannot be continued)."""
        if self.done or self.failed or self.finished:
            return False
        return self.events == 0 or (bool(self.ids) and self.stream_id is not None)

    def resume(self) -> Resume | None:
        """What to continue from; None: nothing reached the client, so the request is simply sent again."""
        if not self.ids or self.stream_id is None:
            return None
        choices = [tuple(self.ids.get(index, ())) for index in range(self.choices)]
        return Resume(self.stream_id, choices[0], tuple(choices[1:]), tuple(sorted(self.finished_choices)))
