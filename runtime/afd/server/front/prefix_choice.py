"""Which attention rank takes a request: the one most likely to hold its prefix, bounded by load. Pure.

A rank's KV cache keeps the prompts it computed (prefix caching), so a request whose leading text another request
already sent to rank R is cheapest on R. The front door does not tokenize: it keys a request by its leading text —
the chat messages rendered as role and content (`prompt_text`), or the raw prompt — cut into `chunk_chars`
chunks, each named by a hash chained over every chunk before it (and the model and `cache_salt`, so requests that
could never share a rank's cached blocks never match). `PrefixMap` remembers, per router replica, which rank
each chunk hash was last sent to, least recently used first out; it is approximate by design (a rank's own
eviction is not seen, another replica's choices are not shared, a restart forgets) and nothing a request needs:
a wrong guess only costs a prefill.

`choose` orders the candidate ranks: ready ones first (the last `/health` said 200: serving, not draining, not
holding for a lost FFN), unready ones last (tried only when every ready one refused). Among ready ranks, the one
with the longest matching chunk chain wins unless its load exceeds the least-loaded ready rank's by more than
`slack_requests` or `slack_ratio` of it, or its KV cache is nearly full (`kv_full`); otherwise the least loaded
(fewest requests, then least KV use in quarters), ties taken in turn so that sequential requests spread evenly.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

CHUNK_CHARS = 128  # about 32 tokens: two KV blocks of 16
MAX_CHUNKS = 512  # 64 KiB of leading text at most is hashed per request
MAP_ENTRIES = 200_000  # chunk hashes remembered per router replica (~40 MB at most)
_DIGEST = 8


@dataclass(frozen=True)
class ChoiceSettings:
    """How far prefix affinity may unbalance the ranks, and how requests are keyed."""

    slack_requests: float = 4.0  # the prefix rank may carry this many requests more than the least-loaded rank,
    slack_ratio: float = 0.5  # or this fraction of its load, whichever is larger
    kv_full: float = 0.95  # a rank whose KV cache is this full gets no request for its prefix alone
    chunk_chars: int = CHUNK_CHARS
    max_chunks: int = MAX_CHUNKS
    map_entries: int = MAP_ENTRIES


@dataclass
class RankLoad:
    """What the front door knows of one rank: requests on it (this replica's in flight, plus the other replicas' by
    the rank's running and waiting gauges), the fraction of its KV cache in use, and whether its last probe said
    ready."""

    requests: float = 0.0
    kv_usage: float = 0.0
    ready: bool = True


def prompt_text(path: str, body: Any) -> str | None:
    """The leading text that keys a request for prefix affinity (None: not a generation request, or unreadable)."""
    if not isinstance(body, dict):
        return None
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        return "".join(_message_text(message) for message in messages)
    if path.endswith("/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]  # several prompts: keyed by the first
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return ",".join(map(str, prompt))
    return None


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return json.dumps(message, sort_keys=True)
    content = message.get("content")
    if isinstance(content, list):  # parts: their text in order, anything else as its JSON
        content = "".join(_part_text(part) for part in content)
    elif not isinstance(content, str):
        content = json.dumps(content, sort_keys=True)
    return f"\x1e{message.get('role', '')}\x1f{content}"


def _part_text(part: Any) -> str:
    """A content part's text; any other part (or a text part whose text is no string: the rank refuses it) as its
    JSON, so that a hostile body is keyed, never an error here."""
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    return json.dumps(part, sort_keys=True)


def chunk_hashes(text: str, seed: str = "", chunk_chars: int = CHUNK_CHARS, max_chunks: int = MAX_CHUNKS) -> list[bytes]:
    """The hash chain over `text`'s whole chunks (a partial last chunk is left out, as a KV cache keeps whole blocks
    only): hash i names chunks 0..i together, under `seed` (model, cache salt)."""
    chained = hashlib.blake2b(seed.encode(errors="surrogatepass"), digest_size=_DIGEST).digest()
    hashes = []
    for start in range(0, min(len(text) // chunk_chars, max_chunks) * chunk_chars, chunk_chars):
        chunk = text[start:start + chunk_chars].encode(errors="surrogatepass")  # JSON may carry lone surrogates
        chained = hashlib.blake2b(chained + chunk, digest_size=_DIGEST).digest()
        hashes.append(chained)
    return hashes


def request_hashes(path: str, body: Any, settings: ChoiceSettings = ChoiceSettings()) -> list[bytes]:
    """The chunk hashes of a request body (empty: no text to key it by)."""
    text = prompt_text(path, body)
    if not text:
        return []
    seed = f"{body.get('model', '')}\x00{body.get('cache_salt', '')}"
    return chunk_hashes(text, seed, settings.chunk_chars, settings.max_chunks)


class PrefixMap:
    """Chunk hash → the rank it was last sent to, the least recently used dropped beyond `entries`."""

    def __init__(self, entries: int = MAP_ENTRIES):
        self.entries = entries
        self._ranks: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ranks)

    def matches(self, hashes: list[bytes]) -> dict[str, int]:
        """Per rank, how many leading chunks of `hashes` were last sent there (the chain stops at the first unknown)."""
        depth: dict[str, int] = {}
        for index, chained in enumerate(hashes):
            rank = self._ranks.get(chained)
            if rank is None:
                break
            depth[rank] = index + 1
        return depth

    def record(self, hashes: list[bytes], rank: str) -> None:
        """`rank` took a request of these chunks: it holds them now. The first chunks are the most recently used, so
        a chain is evicted from its end first."""
        ranks = self._ranks
        for chained in reversed(hashes):
            ranks[chained] = rank
            ranks.move_to_end(chained)
        while len(ranks) > self.entries:
            ranks.popitem(last=False)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop every entry of a rank not in `keep` (ranks that left)."""
        kept = set(keep)
        for chained in [h for h, rank in self._ranks.items() if rank not in kept]:
            del self._ranks[chained]


@dataclass
class Chooser:
    """`choose` with its turn counter (ties among the least loaded are taken in turn) and a `PrefixMap`."""

    settings: ChoiceSettings = field(default_factory=ChoiceSettings)
    turn: int = 0
    prefixes: PrefixMap = field(init=False)

    def __post_init__(self):
        self.prefixes = PrefixMap(self.settings.map_entries)

    def order(self, ranks: list[str], loads: dict[str, RankLoad], hashes: list[bytes]) -> list[str]:
        """`ranks` in the order to try them for a request of `hashes`."""
        self.turn += 1
        return choose(ranks, loads, self.prefixes.matches(hashes) if hashes else {}, self.settings, self.turn)


def choose(ranks: list[str], loads: dict[str, RankLoad], matches: dict[str, int],
           settings: ChoiceSettings = ChoiceSettings(), turn: int = 0) -> list[str]:
    """`ranks` in the order to try them: the chosen one first, then the other ready ranks least loaded first, then
    the unready ones. `matches`: per rank, the matching chunk chain's length; `turn` rotates ties."""
    if not ranks:
        return []
    load = {rank: loads.get(rank) or RankLoad() for rank in ranks}
    ready = [rank for rank in ranks if load[rank].ready]
    unready = [rank for rank in ranks if not load[rank].ready]
    if not ready:
        return _by_load(unready, load, turn)
    least = min(load[rank].requests for rank in ready)
    bound = least + max(settings.slack_requests, settings.slack_ratio * least)
    affine = [rank for rank in ready if matches.get(rank, 0) > 0 and load[rank].requests <= bound
              and load[rank].kv_usage < settings.kv_full]
    spread = _by_load(ready, load, turn)
    if affine:
        best = max(affine, key=lambda rank: (matches[rank], -load[rank].requests))
        spread = [best] + [rank for rank in spread if rank != best]
    return spread + _by_load(unready, load, turn)


def _by_load(ranks: list[str], load: dict[str, RankLoad], turn: int) -> list[str]:
    """Fewest requests first, then least KV use in quarters (a polled gauge's small drift never decides); equal
    ranks in an order that turns with `turn`."""
    if not ranks:
        return []
    rotated = ranks[turn % len(ranks):] + ranks[:turn % len(ranks)]
    return sorted(rotated, key=lambda rank: (load[rank].requests, int(load[rank].kv_usage * 4)))
