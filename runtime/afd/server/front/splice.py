"""A relayed stream that survives its attention rank: cut mid-stream, it goes on from another rank.

The relay passes whole SSE events to the client and notes the token ids they carried
(`afd.server.api.resume.StreamReader`). If the rank's connection breaks before `[DONE]` (the rank died),
`reopen` sends the request to another ready rank with those ids (`x-afd-resume`), and that rank's
events follow on the same connection: same id, same index, nothing sent twice. A stream that ended
with an error event, or that the read timeout cut, ends as before.
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Awaitable, Callable

import httpx

from afd.server.api.resume import Resume, StreamReader
from afd.server.api.sse import DONE, error_event

log = logging.getLogger(__name__)
MAX_MOVES = 4  # ranks one stream may move over


async def spliced(response: httpx.Response, reopen: Callable[[Resume | None], Awaitable[httpx.Response | None]],
                  release: Callable[[httpx.Response], Awaitable[None]],
                  moved: Callable[[float], None] = lambda seconds: None) -> AsyncIterator[bytes]:
    """The client's bytes of `response`'s stream, continued through `reopen` whenever it is cut.

    `reopen(resume)` gives another rank's streaming response (None: no rank could take it); `release` closes a
    response once read; `moved(seconds)` is told each move and how long the stream waited for it.
    """
    reader = StreamReader()
    for move in range(MAX_MOVES + 1):
        try:
            async for chunk in response.aiter_raw():
                if out := reader.feed(chunk):
                    yield out
        except httpx.TimeoutException:
            return  # the rank went silent past the read timeout: the client sees a cut stream, as before
        except httpx.TransportError as err:
            log.warning("attention rank lost mid-stream (%s: %s)", type(err).__name__, err)
        finally:
            await release(response)
        if reader.done or reader.failed:
            return
        if reader.finished:  # cut after its last token: only the end of the stream is missing
            yield DONE.encode()
            return
        if not reader.resumable or move == MAX_MOVES:
            break  # (a rank that does not say its token ids cannot be continued: the client is told, not left cut)
        cut_at = time.monotonic()
        reader.drop_partial()
        following = await reopen(reader.resume())
        if following is None:
            break
        moved(time.monotonic() - cut_at)
        response = following
    yield (error_event("the attention rank serving this stream was lost and no other could continue it")
           + DONE).encode()
