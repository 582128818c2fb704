"""Incremental detokenization and stop strings for streaming.

Text is decoded over a sliding window of token ids so that multi-token characters
are emitted only once complete. Stop strings are searched in the generated text; a
streaming client is sent text only up to where no stop string could still begin.
"""

from __future__ import annotations

from afd.engine.text.tokenizer import text_decoder


class IncrementalDetokenizer:
    """Turns one token at a time into new text, never emitting half a character."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.decode = text_decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.decode
        before = decode(self.ids[self.prefix_offset : self.read_offset])
        after = decode(self.ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character, or a special token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before) :]


class StopChecker:
    """Accumulates text; finds stop strings (kept in the text with `include_stop`); says how much text is safe to
    stream."""

    def __init__(self, stop: tuple[str, ...], include_stop: bool = False):
        self.stop, self.include_stop = stop, include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, delta: str, look: bool = True) -> None:
        """Append `delta`; `look=False`: stop strings are not looked for yet (before `min_tokens`, as vLLM does)."""
        if not self.stop:  # nothing to look for: keep only what is not sent yet (the whole text is never needed)
            self.text = self.text[self.sent:] + delta
            self.sent = 0
            return
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        if not look:
            return
        hits = [(i, i + len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if hits:
            begin, end = min(hits)
            self.text = self.text[: end if self.include_stop else begin]
            self.stopped = True

    def take(self, final: bool) -> str:
        """Text not yet sent that can no longer turn into a stop string."""
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self.hold)
        piece, self.sent = self.text[self.sent : end], end
        return piece
