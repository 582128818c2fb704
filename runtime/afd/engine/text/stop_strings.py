"""Stop strings for streaming.

Stop strings are searched in the generated text; a streaming client is sent text only up to where no stop string
could still begin.
"""

from __future__ import annotations


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
