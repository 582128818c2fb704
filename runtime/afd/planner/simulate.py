"""Synthetic metric streams of an AFD group with known costs, and a fake Prometheus over them:
what the planner and the operator's ratio loop are tested against (the recovered costs must be
the known ones)."""

from __future__ import annotations

import json
import random
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.parser import text_string_to_metric_families

from afd.planner.samples import RankSample, parse_exposition
from afd.config.topology import Topology


class SimulatedGroup:
    """A group whose per-step costs follow known lines (intercept s, slope s/token); emits the
    cumulative /metrics text of its ranks, as the runtime would."""

    def __init__(self, topology: str, stages: int = 1, attention=(2e-3, 1e-4), ffn=(1e-3, 2e-5), host=(4e-3, 2e-5),
                 wire=(5e-4, 1e-6), layers: int = 4, noise: float = 0.0, seed: int = 0, clock: float = 0.0,
                 eager: tuple[float, float] = (1.0, 0.0)):
        self.eager = eager  # profiled steps' layers: (factor, seconds added per layer), as eager kernels on a GPU
        self.topology, self.stages, self.layers, self.noise = Topology.parse(topology), stages, layers, noise
        self.lines = {"attention": attention, "ffn": ffn, "host": host, "wire": wire}
        self.totals: dict[tuple, float] = {}
        self.clock = clock
        self.random = random.Random(seed)

    def cost(self, term: str, tokens: float) -> float:
        intercept, slope = self.lines[term]
        return (intercept + slope * tokens) * (1 + self.random.uniform(-self.noise, self.noise))

    def run(self, concurrency: float, steps: int = 100, profile_every: int = 4) -> None:
        n = concurrency / self.topology.num_attention
        m = concurrency / self.topology.num_ffn
        step = 0.0
        for s in range(steps):
            attention, ffn = self.cost("attention", n), self.cost("ffn", m)
            exposed = ffn if self.stages == 1 else max(0.0, ffn - attention)
            wait = exposed + self.cost("wire", n)
            step = self.cost("host", n) + attention + wait
            for rank in range(self.topology.num_attention):
                self._add("attention", rank, step, n, generated=n)
                if (s + 1) % profile_every == 0:
                    self._layers("attention", rank, self._profiled(attention), self._profiled(wait))
            for rank in range(self.topology.num_ffn):
                self._add("ffn", rank, step, m * self.layers)  # the FFN counts rows once per crossing layer
                if (s + 1) % profile_every == 0:
                    self._layers("ffn", rank, self._profiled(ffn), 0.0)
            self.clock += step

    def _profiled(self, seconds: float) -> float:
        """What a profiled step times for a part costing `seconds` in an ordinary step."""
        factor, per_layer = self.eager
        return seconds * factor + per_layer * self.layers if seconds > 0 else 0.0

    def _add(self, role, rank, seconds, tokens, generated=0.0):
        for key, value in (("afd_step_duration_seconds_sum", seconds), ("afd_step_duration_seconds_count", 1),
                           ("afd_step_tokens_sum", tokens), ("afd_step_tokens_count", 1),
                           ("afd_generation_tokens_total", generated)):
            if role == "attention" or key != "afd_generation_tokens_total":
                self.totals[(key, role, rank, None, None)] = self.totals.get((key, role, rank, None, None), 0) + value

    def _layers(self, role, rank, compute, wait):
        for layer in range(self.layers):
            for name, direction, value in (("afd_layer_compute_seconds", None, compute), ("afd_transfer_seconds", "recv", wait)):
                for suffix, amount in (("_sum", value / self.layers), ("_count", 1)):
                    key = (name + suffix, role, rank, layer, direction)
                    self.totals[key] = self.totals.get(key, 0) + amount

    def exposition(self) -> str:
        lines = []
        for rank_role in [("attention", r) for r in range(self.topology.num_attention)] + \
                         [("ffn", r) for r in range(self.topology.num_ffn)]:
            lines.append(f'afd_group_info{{role="{rank_role[0]}",rank="{rank_role[1]}",topology="{self.topology}",'
                         f'stages="{self.stages}"}} 1')
        for (name, role, rank, layer, direction), value in sorted(self.totals.items(), key=str):
            labels = f'role="{role}",rank="{rank}"'
            if layer is not None:
                labels += f',layer="{layer}"'
            if direction is not None:
                labels += f',direction="{direction}"'
            lines.append(f"{name}{{{labels}}} {value}")
        return "\n".join(lines) + "\n"

    def scrapes(self, loads: list[float]) -> list[list[RankSample]]:
        """A scrape now, then one after running each load (decoding sequences) for 100 steps."""
        out = [parse_exposition(self.exposition(), self.clock)]
        for load in loads:
            self.run(load)
            out.append(parse_exposition(self.exposition(), self.clock))
        return out


class FakePrometheus:
    """Prometheus's `/api/v1/query` over recorded expositions (instant vectors, 5-minute
    lookback, `=` and `=~` matchers): what a Prometheus scraping the group would answer."""

    LOOKBACK_S = 300.0

    def __init__(self) -> None:
        self.records: list[tuple[float, dict[str, str], str]] = []  # (time, target labels, exposition)

    def record(self, at: float, text: str, **target_labels: str) -> None:
        self.records.append((at, target_labels, text))

    def answer(self, params: dict[str, str]) -> dict:
        at = float(params["time"])
        matchers = re.findall(r'(\w+)(=~|=)"((?:[^"\\]|\\.)*)"', params["query"])
        latest: dict[tuple, tuple[float, dict, str]] = {}
        for when, target, text in self.records:
            key = tuple(sorted(target.items()))
            if at - self.LOOKBACK_S <= when <= at and when >= latest.get(key, (float("-inf"),))[0]:
                latest[key] = (when, target, text)
        result = []
        for when, target, text in latest.values():
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    labels = {"__name__": sample.name, **sample.labels, **target}
                    if all(re.fullmatch(v, labels.get(k, "")) if op == "=~" else labels.get(k, "") == v
                           for k, op, v in matchers):
                        result.append({"metric": labels, "value": [when, repr(float(sample.value))]})
        return {"status": "success", "data": {"resultType": "vector", "result": result}}

    def serve(self):
        """Serve on 127.0.0.1 in a daemon thread; returns the server (`server_port`, `shutdown()`)."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                url = urllib.parse.urlparse(self.path)
                params = dict(urllib.parse.parse_qsl(url.query))
                ok = url.path == "/api/v1/query" and "query" in params and "time" in params
                body = json.dumps(fake.answer(params) if ok else {"status": "error", "error": "bad query"}).encode()
                self.send_response(200 if ok else 400)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server
