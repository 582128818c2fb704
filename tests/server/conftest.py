"""A real HTTP server over a loopback AFD group (one FFN thread, one attention rank) per module."""

from __future__ import annotations

import itertools
import socket
import threading
import time

import pytest

_groups = itertools.count()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Outputs:
    """Every output of each request submitted through `submit_all`, in order; `wait` until each finished."""

    def __init__(self, count: int):
        self.lists: list[list] = [[] for _ in range(count)]
        self._finished = threading.Semaphore(0)

    def collector(self, index: int):
        def on_output(out):
            self.lists[index].append(out)
            if out.finished:
                self._finished.release()
        return on_output

    def wait(self, timeout: float) -> list[list]:
        for _ in self.lists:
            assert self._finished.acquire(timeout=timeout), "a request never finished"
        return self.lists


def submit_all(engine, requests) -> Outputs:
    """Submit each (prompt ids, sampling params) to `engine`; their outputs as they arrive."""
    outputs = Outputs(len(requests))
    for index, (prompt, params) in enumerate(requests):
        engine.submit(prompt, params, outputs.collector(index))
    return outputs


class LiveServer:
    def __init__(self, checkpoint, stages=2, max_num_seqs=64, kv_cache_tokens=8192):
        import uvicorn

        from afd.config import AFDConfig
        from afd.roles.attention import build_attention
        from afd.roles.ffn import build_ffn
        from afd.server.api.app import create_app
        from afd.server.serve.engine_api import build_server

        self.config = AFDConfig(
            connector="loopback", model=str(checkpoint), stages=stages, max_num_seqs=max_num_seqs,
            ffn_address_template=f"server-test-{next(_groups)}", peer_timeout_s=3.0,
            ffn_hold_s=0.0,  # a lost FFN fails requests at once here (tests/server/test_engine_hold.py holds them)
        )
        self.ffn = build_ffn(self.config.replace(role="ffn"))
        self.ffn_stop = threading.Event()
        self.ffn_thread = threading.Thread(target=self.ffn.serve, args=(self.ffn_stop,), daemon=True)
        self.ffn_thread.start()
        self.role = build_attention(self.config, kv_cache_tokens)
        self.state, self.engine = build_server(self.config, self.role)
        self.engine.start()
        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.state), host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = self.state.model_name

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.engine.stop()
        self.ffn_stop.set()
        self.ffn_thread.join(5)


@pytest.fixture(scope="module")
def server(checkpoints):
    live = LiveServer(checkpoints["qwen3_moe"])
    yield live
    live.close()
