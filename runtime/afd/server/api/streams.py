"""One request's engine outputs on the HTTP event loop: submitted together (a prompt's choices as one group),
collected whole, or streamed as server-sent events with each choice's index (a moved stream going on from each
choice's carried tokens)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from afd.engine.request import RequestOutput
from afd.server.api import resume as resumes
from afd.server.api.handoff import LoopHandoff, OutputSink
from afd.server.api.http_body import client_gone
from afd.server.api.protocol import Unavailable
from afd.server.api.sse import DONE, StreamEvents, error_event


class Outputs:
    """One request's engine outputs on the event loop, taken as they arrive (see `handoff`)."""

    def __init__(self, engine, prompt: list[int], params, group: str | None = None):
        handoff, sink = LoopHandoff.of(asyncio.get_running_loop()), OutputSink()
        self.sink = sink
        self.engine = engine
        shared = {"group": group} if group is not None else {}
        self.request = engine.submit(prompt, params, lambda out: handoff.put(sink, out), **shared)
        self.finished = False
        self.first = True

    async def take(self) -> list[tuple[RequestOutput, bool]]:
        """Every output that arrived since the last call (waits for one), each with whether it is the
        request's first; nothing after the last."""
        if self.finished:
            return []
        taken = []
        for output in await self.sink.take():
            taken.append((output, self.first))
            self.first = False
            if output.finished:
                self.finished = True
                break
        return taken

    async def collect(self) -> list[RequestOutput]:
        collected = []
        while taken := await self.take():
            for output, _ in taken:
                if output.error:
                    raise Unavailable(f"the request failed: {output.error}")
                collected.append(output)
        return collected

    def abort(self) -> None:
        if not self.finished:
            self.engine.abort(self.request.request_id)


def group_of(count: int) -> str | None:
    """The engine group of one prompt's `count` choices (they share its prefill), or None for one."""
    return uuid.uuid4().hex if count > 1 else None


def submit_all(engine, prompts: list[list[int]], params, groups: list) -> list[Outputs]:
    """Every prompt queued at once (they batch together; the choices of one prompt, one group each, share its
    prefill); none left behind if one is refused."""
    outputs: list[Outputs] = []
    try:
        with engine.together():
            for prompt, sampling, group in zip(prompts, params, groups):
                outputs.append(Outputs(engine, prompt, sampling, group))
    except BaseException:
        for submitted in outputs:
            submitted.abort()
        raise
    return outputs


async def complete(http: Request, outputs: list[Outputs]) -> list[list[RequestOutput]] | None:
    """Every output of a non-streaming request, or None when the client left first (all aborted)."""
    gone = asyncio.ensure_future(client_gone(http))
    work = asyncio.ensure_future(asyncio.gather(*(o.collect() for o in outputs)))
    try:
        await asyncio.wait({gone, work}, return_when=asyncio.FIRST_COMPLETED)
        return work.result() if work.done() else None
    finally:
        gone.cancel()
        work.cancel()
        work.add_done_callback(lambda done: done.cancelled() or done.exception())  # nobody awaits it any more
        for output in outputs:
            output.abort()  # the engine drops them at its next step


class StreamedChoices:
    """The choices of one streamed prompt (n engine requests, queued together), their outputs taken together as they
    arrive, each with its choice's index; a moved stream (`resume`) goes on from each choice's carried tokens (a
    choice whose last event went out before the move is not run again)."""

    def __init__(self, engine, prompt: list[int], params: list, resume: resumes.Resume | None = None):
        handoff, self.sink = LoopHandoff.of(asyncio.get_running_loop()), OutputSink()
        self.engine, self.n = engine, len(params)
        carried = resume.choices if resume is not None else [()] * self.n
        finished = set(resume.finished) if resume is not None else set()
        group = {"group": group_of(self.n)} if resume is None and self.n > 1 else {}
        if resume is not None:  # nothing of the prompt is shown again: its logprobs are not computed again
            params = [dataclasses.replace(p, prompt_logprobs=None) for p in params]
        self.request_ids: dict[int, str] = {}
        self.open = set(range(self.n)) - finished  # choices not finished yet
        self.started = {i for i in range(self.n) if carried[i] or i in finished}  # choices the client saw
        self.tokens = [len(ids) for ids in carried]  # each choice's completion tokens so far
        self.prompt_tokens = len(prompt)
        self.cached_tokens = 0  # of the prompt, found in the prefix cache (the most any choice found)
        try:
            with engine.together():
                for index in sorted(self.open):
                    more = {"carried": carried[index]} if carried[index] else group
                    submitted = engine.submit(prompt, params[index], self._deliver(handoff, index), **more)
                    self.request_ids[index] = submitted.request_id
        except BaseException:
            self.abort()
            raise
        self.request_id = next(iter(self.request_ids.values()))  # the stream's id

    def _deliver(self, handoff: LoopHandoff, index: int):
        return lambda output: handoff.put(self.sink, (index, output))

    @property
    def finished(self) -> bool:
        return not self.open

    async def take(self) -> list[tuple[int, RequestOutput, bool]]:
        """Every output that arrived since the last call (waits for one): (choice index, output, whether it is the
        choice's first); nothing after a choice's last."""
        taken = []
        for index, output in await self.sink.take():
            if index not in self.open:
                continue
            taken.append((index, output, index not in self.started))
            self.started.add(index)
            self.tokens[index], self.prompt_tokens = output.completion_tokens, output.prompt_tokens
            self.cached_tokens = max(self.cached_tokens, output.cached_tokens)
            if output.finished:
                self.open.discard(index)
        return taken

    def abort(self) -> None:
        for index, request_id in self.request_ids.items():
            if index in self.open:
                self.engine.abort(request_id)


def sse_response(outputs: StreamedChoices, events: StreamEvents, make_event, include_usage: bool,
         ids: bool = False) -> StreamingResponse:
    """Server-sent events: one per output of any choice, an error event if one fails (the others are aborted), then
    the usage (the prompt once, every choice's tokens) and [DONE]. The events of every output that arrived together
    go out in one write. `ids`: a relay asked, to move the stream should this rank die: each event says its token
    ids in an SSE comment (with its choice's index, after n said once, in a stream of n > 1 choices)."""
    n = outputs.n
    if not ids:
        note = lambda index, output: ""  # noqa: E731
    elif n == 1:
        note = lambda index, output: resumes.ids_comment(output.token_ids)  # noqa: E731
    else:
        note = lambda index, output: resumes.ids_comment(output.token_ids, index)  # noqa: E731
    opening = resumes.choices_comment(n) if ids and n > 1 else ""

    async def stream():
        nonlocal opening
        try:
            while not outputs.finished:
                lines = []
                for index, output, first in await outputs.take():
                    if output.error:
                        lines.append(error_event(output.error))
                        yield "".join(lines)
                        return
                    lines.append(opening + note(index, output) + make_event(index, output, first))
                    opening = ""
                if outputs.finished:
                    if include_usage:
                        lines.append(events.usage(outputs.prompt_tokens, sum(outputs.tokens), outputs.cached_tokens))
                    lines.append(DONE)
                yield "".join(lines)
        finally:
            outputs.abort()  # a client that disconnects mid-stream frees its sequences

    return StreamingResponse(stream(), media_type="text/event-stream")
