"""Incremental detokenization for streaming.

Text is decoded over a sliding window of token ids so that multi-token characters
are emitted only once complete.
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
