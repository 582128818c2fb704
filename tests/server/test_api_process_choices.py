"""n choices through an API process (`AFD_API_PROCESS`) share the prompt's prefill whenever the core polls: the
choices of one `EngineClient.together()` reach the core as one message, admitted in one `Engine.together()`."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import zmq

from afd.engine.engine import Engine
from afd.engine.request import SamplingParams
from afd.kv.cache import KVBlocks, KVCache
from afd.runners.monolithic_runner import MonolithicRunner
from afd.server.api_process.core_link import ApiLink
from afd.server.api_process.core_wire import CoreState
from afd.server.api_process.engine_client import EngineClient
from tests.server.test_shared_prompt import Counting

N, MAX_TOKENS, LENGTH = 4, 5, 40


def settled(engine: Engine) -> bool:
    """Every request the engine took has its whole prompt scheduled: a choice arriving now cannot ride a prefill."""
    return engine.num_waiting == 0 and all(r.cached_tokens >= len(r.prompt_ids) for r in list(engine.scheduler.running))


class OnePerPoll:
    """The link's request socket, made to give one message per poll and to poll only once the engine settled: the
    worst case of the race between an API process's sends and the core's polls, made deterministic."""

    def __init__(self, socket, engine: Engine):
        self.socket, self.engine, self.given = socket, engine, False

    def poll(self, timeout_ms: int) -> int:
        deadline = time.monotonic() + 30
        while not settled(self.engine):
            assert time.monotonic() < deadline, "the engine never took its requests"
            time.sleep(0.005)
        self.given = False
        return self.socket.poll(timeout_ms)

    def recv(self, flags: int = 0) -> bytes:
        if self.given:
            raise zmq.Again()
        self.given = True
        return self.socket.recv(flags)

    def close(self) -> None:
        self.socket.close()


@pytest.fixture(scope="module")
def parts(checkpoints):
    from afd.engine.text.tokenizer import load_tokenizer
    from afd.models.loader import load_model

    return load_model(str(checkpoints["qwen3_moe"])), load_tokenizer(str(checkpoints["qwen3_moe"]))


def test_n_choices_from_an_api_process_prefill_once_when_the_core_polls_between_messages(parts, tmp_path):
    loaded, tokenizer = parts
    cache = KVCache.for_tokens(loaded.model.kv_layouts(), 1024, torch.float32, "cpu")
    step = Counting(MonolithicRunner(loaded, cache))
    engine = Engine(step, cache, tokenizer, (), max_num_seqs=8, max_model_len=256, max_num_batched_tokens=8192).start()
    step.owners = engine.scheduler.blocks
    link = ApiLink(engine, str(tmp_path), lambda: CoreState(None, None), beat_s=0.05)
    link._requests = OnePerPoll(link._requests, engine)
    link.start()
    client = EngineClient(str(tmp_path), tokenizer, KVBlocks(cache.num_blocks, cache.block_size), 8, 8192, 256,
                          beat_s=0.05)
    prompt = [(7 * i + 3) % 200 + 5 for i in range(LENGTH)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11 + j, ignore_eos=True) for j in range(N)]
    got: list[list] = [[] for _ in range(N)]

    async def scenario():
        loop = asyncio.create_task(client.run(lambda: True, lambda: None))
        while client.heard is None:  # the core's beat came: its outputs reach this client
            await asyncio.sleep(0.01)
        with client.together():
            for j in range(N):
                client.submit(prompt, params[j], got[j].append, group="g")
        while not all(outs and outs[-1].finished for outs in got):
            await asyncio.sleep(0.02)
        loop.cancel()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        client.close()
        link.close()
        engine.stop()
    assert all(o.error is None for outs in got for o in outs)
    choices = [[t for o in outs for t in o.token_ids] for outs in got]
    assert all(len(tokens) == MAX_TOKENS for tokens in choices) and len({tuple(t) for t in choices}) > 1
    assert step.fed == LENGTH + N * (MAX_TOKENS - 1)  # the prompt once, then every choice's decodes
    assert cache.free_blocks == cache.num_blocks and not engine.scheduler.blocks.shared
