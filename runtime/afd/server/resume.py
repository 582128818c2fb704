"""Moving a stream to another attention rank (issue 38): the internal resume header, and reading a relayed stream.

A relay (the front door of `afd up`, or a rank's failover relay) asks the rank for each event's token
ids (`x-afd-token-ids: 1`: the rank puts an SSE comment line `: afd-ids 12,34` in the event, which
clients ignore and the relay strips). When the rank dies mid-stream, the relay sends the same request
to another rank with `x-afd-resume`: the stream's id and the token ids its client already has, signed
with the deployment's group secret (HMAC-SHA256), so no outside client can make a rank continue a
made-up output. That rank prefills prompt + those tokens, re-emits none of them (no role chunk, no
echo), and streams the rest under the same id; its usage counts every token once.
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
CHOICES_COMMENT = b": afd-choices "  # a stream of n > 1 choices says n (its first event): it has no ids and never moves
MAX_CARRIED = 2048  # token ids in one resume header: 11 KB, within the HTTP servers' 16 KB header limit
_STREAM_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_PREFIXES = {"text_completion": "cmpl-", "chat.completion.chunk": "chatcmpl-"}


@dataclass(frozen=True)
class Resume:
    """A stream to continue: its id (as the client saw it) and the token ids the client already has."""

    stream_id: str
    token_ids: tuple[int, ...]

    def request_id(self, kind: str) -> str:
        """The engine request id that gives this stream id for events of `kind`."""
        prefix = _PREFIXES[kind]
        if not self.stream_id.startswith(prefix):
            raise InvalidRequest(f"the resumed stream id {self.stream_id[:64]!r} is not a {kind} id", RESUME_HEADER)
        return self.stream_id[len(prefix):]


def sign(key: bytes, resume: Resume) -> str:
    """The header value for `resume`: `stream id.token ids (int32 little-endian, base64url).MAC`."""
    ids = array("i", resume.token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    payload = f"{resume.stream_id}.{base64.urlsafe_b64encode(ids.tobytes()).decode()}"
    return f"{payload}.{_mac(key, payload)}"


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
    stream_id, _, packed = payload.partition(".")
    ids = array("i")
    try:
        ids.frombytes(base64.b64decode(packed.encode(), altchars=b"-_", validate=True))
    except (ValueError, binascii.Error):
        raise InvalidRequest(f"{RESUME_HEADER} is not a valid resume", RESUME_HEADER) from None
    if sys.byteorder != "little":
        ids.byteswap()
    if not _STREAM_ID.fullmatch(stream_id) or not 0 < len(ids) <= MAX_CARRIED:
        raise InvalidRequest(f"{RESUME_HEADER} needs a stream id and 1..{MAX_CARRIED} token ids", RESUME_HEADER)
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"{RESUME_HEADER} holds a token id outside the vocabulary", RESUME_HEADER)
    return Resume(stream_id, tuple(ids))


def _mac(key: bytes, payload: str) -> str:
    return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


def ids_comment(token_ids: list[int]) -> str:
    """The comment line a rank puts in an event for a relay that asked for token ids."""
    return f": afd-ids {','.join(map(str, token_ids))}\n"


def choices_comment(n: int) -> str:
    """The comment line a rank puts in the first event of a stream of `n` > 1 choices for a relay that asked for ids:
    such a stream says no ids (they would be every choice's, interleaved), so it is not moved mid-way."""
    return f": afd-choices {n}\n"


class StreamReader:
    """What of a relayed SSE stream reached the client: whole events only, id comments stripped and gathered."""

    def __init__(self):
        self._pending = b""
        self.stream_id: str | None = None
        self.token_ids: list[int] = []
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
                    self.token_ids.extend(int(t) for t in line[len(IDS_COMMENT):].split(b",") if t)
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
    def finished(self) -> bool:
        """Every choice's last event went out: only [DONE] (and usage) can be missing."""
        return len(self.finished_choices) >= self.choices

    def drop_partial(self) -> None:
        """Forget a cut event's first bytes (the client never got them)."""
        self._pending = b""

    @property
    def resumable(self) -> bool:
        """Cut before its end (not by an error event, not after its last token), and either nothing went out yet or
        the token ids of what did are known (a rank that does not say them, e.g. vLLM's, or a stream of n > 1 choices,
        cannot be continued)."""
        if self.done or self.failed or self.finished:
            return False
        return self.events == 0 or (self.choices == 1 and bool(self.token_ids) and self.stream_id is not None)

    def resume(self) -> Resume | None:
        """What to continue from; None: nothing reached the client, so the request is simply sent again."""
        if not self.token_ids or self.stream_id is None:
            return None
        return Resume(self.stream_id, tuple(self.token_ids))
