"""`afd up`: a supervised local AFD deployment behind one OpenAI-compatible URL.

Starts every FFN and attention rank as its own `afd serve` process on 127.0.0.1,
waits until each attention rank reports healthy, serves the front door, restarts
ranks that die, keeps a JSON state file current, and stops everything on Ctrl-C
or SIGTERM.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from afd.config import AFDConfig, config_to_env, process_setting
from afd.local.group_processes import local_zmq_config
from afd.local.children import LocalProcesses, exit_summary, free_port_block, threads_per_rank
from afd.server.api.api_keys import ApiKeys, bearer
from afd.server.front.door import Backends, FrontSettings, create_front_app
from afd.checkpoint_tools.tiny import make_tiny_model
from afd.local.up_messages import WaitReport, demo_answer

log = logging.getLogger(__name__)


def progress(message: str) -> None:
    print(f"afd up: {message}", file=sys.stderr, flush=True)


def ensure_tiny_model(cache: Path | None = None, arch: str = "qwen3_moe") -> Path:
    """The default demo model, made once with `afd make-tiny-model` and cached (in `AFD_CACHE_DIR`)."""
    path = (cache or process_setting("AFD_CACHE_DIR")) / f"tiny-{arch}"
    if not (path / "config.json").exists():
        progress(f"making a tiny random {arch} checkpoint in {path} (first run only)")
        partial = path.with_name(path.name + ".partial")
        make_tiny_model(arch, partial, seed=0)
        partial.rename(path)
    return path


@dataclass
class Rank:
    role: str
    rank: int
    config: AFDConfig

    @property
    def name(self) -> str:
        group = self.config.group
        if self.role == "ffn" and group.ffn_expert_parallel > 1:
            return f"ffn-{self.rank}-shard-{group.ffn_shard}"
        return f"{self.role}-{self.rank}"

    def describe(self, pid: int) -> dict:
        group = self.config.group
        entry = {"role": self.role, "rank": self.rank, "pid": pid,
                 "metrics": f"http://127.0.0.1:{self.config.process.metrics_port}/metrics"}
        if self.role == "ffn":
            if group.ffn_expert_parallel > 1:
                entry["shard"] = group.ffn_shard
            control, data = self.config.link.ffn_ports(group.ffn_endpoint(self.rank, group.ffn_shard))
            entry.update(control=f"tcp://127.0.0.1:{control}", data=f"tcp://127.0.0.1:{data}")
        else:
            entry["api"] = f"http://127.0.0.1:{self.config.api.http_port}/v1"
        return entry


def plan_ranks(base: AFDConfig) -> list[Rank]:
    """Every rank of the group with its own ports on 127.0.0.1 (FFN ranks first)."""
    config = local_zmq_config(base)
    topology = config.group.topology
    if base.group.role == "monolithic":  # one process, the whole model
        first = free_port_block(2)
        return [Rank("monolithic", 0, config.replace(rank=0, http_host="127.0.0.1", http_port=first, metrics_port=first + 1))]
    shards = config.group.ffn_expert_parallel
    ports = iter(range(free_port_block(topology.num_ffn * shards + 2 * topology.num_attention), 65536))
    ranks = [Rank("ffn", f, config.replace(role="ffn", rank=f, ffn_shard=s, http_host="127.0.0.1", metrics_port=next(ports)))
             for f in range(topology.num_ffn) for s in range(shards)]
    ranks += [Rank("attention", a, config.replace(role="attention", rank=a, http_host="127.0.0.1",
                                                  http_port=next(ports), metrics_port=next(ports)))
              for a in range(topology.num_attention)]
    return ranks


class Supervisor:
    """Keeps every rank running by restarting the ones that die."""

    def __init__(self, ranks: list[Rank], processes: LocalProcesses, state_file: Path | None, api: str):
        self.ranks = {rank.name: rank for rank in ranks}
        self.processes = processes
        self.state_file = state_file
        self.api = api
        self.restarts = 0
        self._stop = threading.Event()
        self._released = threading.Event()

    def start_all(self) -> None:
        for rank in self.ranks.values():
            self._start(rank)

    def _start(self, rank: Rank) -> None:
        env = {**config_to_env(rank.config), **threads_per_rank(len(self.ranks))}
        self.processes.start(rank.name, ["serve"], env)

    def attention_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{r.config.api.http_port}" for r in self.ranks.values() if r.role != "ffn"]

    def probe_bases(self) -> dict[str, str]:
        """Each attention rank's API URL → its probe server (readiness, load gauges) on the metrics port."""
        return {f"http://127.0.0.1:{r.config.api.http_port}": f"http://127.0.0.1:{r.config.process.metrics_port}"
                for r in self.ranks.values() if r.role != "ffn"}

    def metrics_urls(self) -> dict[str, str]:
        return {name: f"http://127.0.0.1:{r.config.process.metrics_port}/metrics" for name, r in self.ranks.items()}

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(self.attention_urls())
        report = WaitReport(len(pending), time.monotonic())
        while pending:
            self._check_alive()
            for url in list(pending):
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        pending.discard(url)
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"attention ranks at {sorted(pending)} not healthy after {timeout_s:.0f} s")
            if line := report.update(len(pending), time.monotonic()):  # at first, on news, or after 30 s
                progress(line)
            if pending:
                time.sleep(0.2)

    def _check_alive(self) -> None:
        for name, child in self.processes.children.items():
            if child.poll() is not None:
                raise RuntimeError(f"{name} exited during start-up: {self.processes.last_error(name)}")

    def write_state(self) -> None:
        if not self.state_file:
            return
        ranks = [rank.describe(self.processes.children[rank.name].pid) for rank in self.ranks.values()]
        temporary = self.state_file.with_suffix(".tmp")
        temporary.write_text(json.dumps({"api": self.api, "ranks": ranks}, indent=2))
        temporary.replace(self.state_file)

    def watch(self) -> None:
        """Restart dead ranks until `stop`; runs in a background thread.

        Only the dead rank restarts: attention ranks whose FFN rank died re-handshake with
        the new one by themselves, and an FFN rank drops a dead attention peer on its own.
        After `stop` the thread waits for `release`: the ranks it restarted die with the
        thread that started them (PR_SET_PDEATHSIG), so it outlives their orderly stop.
        """
        try:
            self._restart_dead()
        finally:
            self._released.wait()

    def _restart_dead(self) -> None:
        while not self._stop.wait(0.5):
            dead = [name for name, child in self.processes.children.items() if child.poll() is not None]
            for name in sorted(dead, key=lambda n: not n.startswith("ffn")):
                progress(f"restarting {name} (it exited with code {self.processes.children[name].returncode})")
                self._start(self.ranks[name])
            if not dead:
                continue
            self.restarts += len(dead)
            try:
                self.wait_healthy(timeout_s=300)
            except RuntimeError as err:
                progress(f"restart did not recover: {err}")
            self.write_state()

    def stop(self) -> None:
        """No more restarts (the ranks are about to be stopped)."""
        self._stop.set()

    def release(self) -> None:
        """Every rank has stopped: the watch thread may end."""
        self._released.set()


def run_up(base: AFDConfig, port: int, state_file: Path | None, demo: bool = True, start_timeout_s: float = 600,
           front: FrontSettings | None = None) -> int:
    front = front or FrontSettings(max_request_bytes=base.api.max_request_bytes)
    if not base.group.group_secret:  # the ranks' secret: signs the handshake and the streams the front door moves
        base = base.replace(group_secret=secrets.token_hex(16))
    front = dataclasses.replace(front, resume_key=base.group.group_secret.encode(),
                                api_keys=ApiKeys(base.api.api_keys))

    ranks = plan_ranks(base)
    api = f"http://127.0.0.1:{port}/v1"
    with LocalProcesses(grace_s=front.shutdown_grace_s) as processes:
        supervisor = Supervisor(ranks, processes, state_file, api)
        shape = "a monolithic rank" if base.group.role == "monolithic" else str(base.group.topology)
        progress(f"starting {shape} ({len(ranks)} processes; logs in {processes.workdir})")
        supervisor.start_all()
        supervisor.wait_healthy(start_timeout_s)
        watcher = threading.Thread(target=supervisor.watch, name="supervisor", daemon=True)
        watcher.start()
        app = create_front_app(Backends(supervisor.attention_urls, supervisor.metrics_urls, supervisor.probe_bases), front)
        # SIGTERM: stop taking requests, give in-flight relays a short grace, then cut them (never hang).
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=30,
                                               timeout_graceful_shutdown=max(1, round(front.shutdown_grace_s))))
        # The state file names the API URL: write it once that URL answers, so its readers can use it at once.
        threading.Thread(target=_when_serving, args=(server, supervisor.write_state), daemon=True).start()
        if demo:
            threading.Thread(target=_demo_request, args=(api, base.load.model, server, base.api.api_keys),
                             daemon=True).start()
        try:
            server.run()
        except KeyboardInterrupt:
            pass  # Ctrl-C or SIGTERM: a requested stop, not an error
        finally:
            supervisor.stop()
            progress("stopping every rank")
            # Attention ranks first: they say Goodbye to a live FFN rank instead of chasing a lost one.
            processes.stop(*(rank.name for rank in ranks if rank.role != "ffn"))
            processes.stop_all()
            progress(f"stopped every rank: {exit_summary({n: c.returncode for n, c in processes.children.items()})}")
            supervisor.release()
    return 0


def _when_serving(server, action) -> None:
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    action()


def _demo_request(api: str, model: str, server, api_keys: tuple[str, ...] = ()) -> None:
    """Once the front door is up, answer one real request so a newcomer sees it work (with the first API key)."""
    while not server.started:
        time.sleep(0.1)
    body = {"model": Path(model).name, "messages": [{"role": "user", "content": "Hello! What is AFD?"}],
            "max_tokens": 24, "temperature": 0}
    try:
        reply = httpx.post(f"{api}/chat/completions", json=body, headers=bearer(api_keys), timeout=120).json()
        for line in demo_answer(reply, model, process_setting("AFD_CACHE_DIR")):  # saying so where the weights are random
            progress(line)
    except Exception as err:  # the demo must never take the deployment down
        progress(f"demo request failed: {err}")
    key = ' -H "Authorization: Bearer <key>"' if api_keys else ""  # never the key itself
    progress(f"ready: {api}  (try: curl{key} {api}/models ; Ctrl-C stops everything)")
