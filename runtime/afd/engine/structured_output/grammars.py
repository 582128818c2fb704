"""Structured outputs with llguidance: grammars compiled once and cached, a matcher per request.

A request's `SamplingParams.grammar` is an llguidance grammar (made from a JSON schema, a
regex, a choice list or a Lark grammar by `afd.server.api.structured`). `Grammars.matcher` gives
each request its own matcher, a copy of a cached prototype, so a grammar is compiled once per
process (the API compiles it on its worker pool first: `Grammars.check`). Each step's masks are
`afd.engine.structured_output.step_mask`'s.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from llguidance import LLMatcher

from afd.engine.request import InvalidRequest

CACHED_GRAMMARS = 128


class Grammars:
    """llguidance's view of the tokenizer and a cache of compiled grammar prototypes (thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        import llguidance.hf  # local import: it loads transformers (seconds); built on the first structured request

        eos = sorted(eos_token_ids) or None  # None: the tokenizer's own EOS
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._prototypes: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, grammar: str, field: str) -> None:
        """Compile `grammar` (cached) or raise `InvalidRequest` naming `field`."""
        self._prototype(grammar, field)

    def matcher(self, grammar: str, field: str = "response_format"):
        """A fresh matcher of `grammar` for one request."""
        return self._prototype(grammar, field).deep_copy()

    def _prototype(self, grammar: str, field: str):
        with self._lock:
            found = self._prototypes.get(grammar)
            if found is not None:
                self._prototypes.move_to_end(grammar)
                return found
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"{field}: the grammar does not compile: {matcher.get_error()}", field)
        with self._lock:
            self._prototypes[grammar] = matcher
            while len(self._prototypes) > CACHED_GRAMMARS:
                self._prototypes.popitem(last=False)
        return matcher


def consume(matcher, token: int) -> None:
    """Advance `matcher` by a sampled token (a stopped or failed matcher stays as it is)."""
    if not matcher.is_stopped() and not matcher.is_error():
        matcher.consume_token(token)
