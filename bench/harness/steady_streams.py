"""Streaming clients that keep sending requests until told to stop: a steady load whose size can change.

Each client sends streamed completions back to back (prompts of random token ids, lengths uniform in
`prompt_tokens`, greedy, ignore_eos, max_tokens uniform in [output_tokens / 2, output_tokens] so the
clients drift apart). Tokens received so far = TTFTs + ITLs recorded (`bench.harness.clients.one_request`).
"""

from __future__ import annotations

import asyncio
import random
import time

from bench.harness.clients import one_request


class SteadyStreams:
    def __init__(self, client, api: str, model: str, prompt_tokens: tuple[int, int], output_tokens: int,
                 vocab: int, seed: int = 0):
        self.client, self.api, self.model = client, api, model
        self.prompt_tokens, self.output_tokens, self.vocab = prompt_tokens, output_tokens, vocab
        self.rng = random.Random(seed)
        self.ttfts: list[float] = []
        self.itls: list[float] = []
        self.failures: list[str] = []
        self._stops: list[list[bool]] = []  # per client: [stop after the current request]
        self._tasks: list[asyncio.Task] = []

    @property
    def received(self) -> int:
        return len(self.ttfts) + len(self.itls)

    @property
    def active(self) -> int:
        return sum(not stop[0] for stop in self._stops)

    def resize(self, count: int, spread_s: float) -> None:
        """Run `count` clients: new ones start spread over `spread_s`; surplus ones stop after their current request."""
        running = [stop for stop in self._stops if not stop[0]]
        for stop in running[count:]:
            stop[0] = True
        new = count - len(running)
        for index in range(max(new, 0)):
            stop = [False]
            self._stops.append(stop)
            self._tasks.append(asyncio.create_task(self._client(stop, index * spread_s / new)))

    async def hold(self, seconds: float) -> bool:
        """Let the load run `seconds`; False as soon as a request has failed."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.failures:
                return False
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return not self.failures

    async def close(self) -> None:
        """Stop every client after its current request, and wait for them."""
        for stop in self._stops:
            stop[0] = True
        await asyncio.gather(*self._tasks)

    async def _client(self, stop: list[bool], delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        while not stop[0]:
            prompt = [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(*self.prompt_tokens))]
            max_tokens = self.rng.randint(max(1, self.output_tokens // 2), self.output_tokens)
            try:
                got = await one_request(self.client, self.api, self.model, prompt, max_tokens, self.ttfts, self.itls)
                if got != max_tokens:
                    self.failures.append(f"{got} of {max_tokens} tokens")
            except Exception as err:  # noqa: BLE001 — every failure is counted and reported
                self.failures.append(f"{type(err).__name__}: {err}")
