"""The server side of `output_path.py`: the real app and engine around a stand-in step, in one process or
with the API in its own (`--split`). Run as `output_path.py --serve PORT` with the tree under test on
PYTHONPATH, so every `afd` import here is the tree's (hence inside the functions).
"""

from __future__ import annotations

import json
import time

from bench.serving.output_path_cpu import Timers, child_pids, instrument, proc_cpu, thread_cpu

TEXT = ("The attention layers keep the keys and values of every sequence, while the experts of the feed-forward "
        "layers are shared by all of them; splitting the two lets each side run on the hardware that suits it. ")


def serve(port: int, step_ms: float, tokenizer_path: str, profile: str | None = None, split: bool = False) -> None:
    import torch
    import uvicorn
    from prometheus_client import CollectorRegistry

    from afd.engine.engine import Engine
    from afd.engine.text.tokenizer import load_tokenizer
    from afd.kv.cache import KVCache
    from afd.models.spec import KVLayout
    from afd.server.api.app import ServerState, create_app
    from afd.server.front.failover import Failover, FailoverSettings
    from afd.server.serve.serving_metrics import ServingMetrics

    timers = Timers()
    instrument(timers)
    tokenizer = load_tokenizer(tokenizer_path)
    text_ids = torch.tensor(tokenizer.encode(TEXT))
    vocab = len(tokenizer)
    spelled = torch.full((len(text_ids), vocab), -1.0)
    spelled[torch.arange(len(text_ids)), text_ids] = 1.0  # row p: logits whose argmax is the text's token p

    def step(input_ids, layout):
        if step_ms:
            time.sleep(step_ms / 1e3)
        ends = torch.tensor([c + n for c, n in zip(layout.context_lens, layout.new_lens)])
        return spelled[ends % len(text_ids)]  # [sequences, vocab]

    registry = CollectorRegistry()
    metrics = ServingMetrics(registry, 0)
    cache = KVCache([KVLayout(1, 1, 1)], 32768, torch.float32, "cpu")
    engine = Engine(step, cache, tokenizer, [0, 2], 512, 4096, 16384, "cpu", observer=metrics)
    metrics.track(engine)
    state = ServerState(engine=engine, tokenizer=tokenizer, model_name="stand-in", max_model_len=4096, vocab_size=vocab,
                        health=lambda: engine.problem, registry=registry)
    def stats():
        if profile:  # written at every call: uvicorn ends the process by the signal
            profiler.dump_stats(profile)  # which stops it
            profiler.enable()
        threads = {f"core:{k}" if split else k: v for k, v in thread_cpu().items()}
        core = time.process_time()
        api = 0.0
        for pid in child_pids() if split else []:
            for name, seconds in proc_cpu(pid).items():
                threads[name] = threads.get(name, 0.0) + seconds
                api += seconds
        processes = {"proc:core": core, "proc:api": api} if split else {}
        return {"cpu_s": core + api, "threads": {**threads, **processes}, "stages": timers.seconds,
                "present": sorted(timers.present), "tokens": registry.get_sample_value("afd_generation_tokens_total", {"role": "attention", "rank": "0"})}

    engine.start()
    if split:
        serve_split(port, engine, state, tokenizer_path, stats)
        return
    app = create_app(state)

    @app.get("/bench/stats")
    async def stats_route():  # on the event loop, as the rest of the app
        return stats()
    server = uvicorn.Server(uvicorn.Config(Failover(app, lambda: False, FailoverSettings()),
                                           host="127.0.0.1", port=port, log_level="warning"))
    if profile:  # the event loop's thread, in CPU time (waits for the GIL are not its code's cost)
        import cProfile

        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
    server.run()
    engine.stop()


def serve_split(port: int, engine, state, tokenizer_path: str, stats) -> None:
    """The API in a child process, as `afd serve` with AFD_API_PROCESS=1; the stats on port + 2."""
    import signal
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from afd.config import AFDConfig
    from afd.server.api_process.core import serve_with_api_process
    from afd.server.serve.engine_api import attention_probes

    class Stats(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps(stats()).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    threading.Thread(target=ThreadingHTTPServer(("127.0.0.1", port + 2), Stats).serve_forever, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    config = AFDConfig(role="monolithic", model=tokenizer_path, api_process=True, http_host="127.0.0.1", http_port=port,
                       metrics_port=port + 1, max_num_seqs=512, max_num_batched_tokens=16384, shutdown_grace_s=5)
    serve_with_api_process(config, stop, state, engine, lambda listening: attention_probes(state, listening, stop))
