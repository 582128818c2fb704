"""No request lost while rank pods die (issue 38), on a real single-node cluster; and the tiny
DeepSeek-V3 sample answering through its client Service (issue 32).

The soak: the operator (the chart) runs the CPU zmq sample as 2 groups of 2 attention ranks and
1 FFN rank; 8 streaming greedy clients ask through the client Service for AFD_SOAK_S seconds
(300) while, every 30–60 s, a random rank pod (attention or FFN, any group) is deleted. Asserted:
every request completes (HTTP 200, `[DONE]`, no error event, every token once, one id) and its
text equals the same prompt's text in an undisturbed run before the soak. Reported: requests,
deletions, the seconds until each deleted pod's replacement was Ready, and the latency of the
requests that ran during those waits (whole request and longest pause between two chunks)
against the others. The table is printed (`pytest -s`) and written to $AFD_E2E_REPORT when set.

Needs the kit with a node (node_kit.py); skips otherwise. AFD_E2E_REUSE_IMAGES=1 skips the
image build (the node keeps the last import); AFD_SOAK_SEED picks the deletions (default 38).
AFD_SOAK_KILL_FFN=1: an FFN victim is not deleted but crashes (SIGKILL of its processes from the
host; the kubelet restarts the container in the same pod), so its attention ranks hold their
requests until it is back instead of finishing them in the FFN's drain. AFD_SOAK_LOGS=DIR keeps
every rank container's log there (`kubectl logs -f`, one file per pod and restart).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from node_kit import OPERATOR_IMAGE, RUNTIME_IMAGE, build_and_import_images, node_cluster_or_skip, service_url, tiny_model_on_the_host
from real_cluster import Cluster, HelmRelease, eventually
from test_real_node_e2e import SERVED, Steps, _answers, _operator_ready, _sample

pytestmark = pytest.mark.timeout(2400)
NAME = "tiny-cpu"
CLIENTS = 8
TOKENS = 24
PROMPTS = [f"Request {i}: the weather in city number {i} is" for i in range(CLIENTS)]
GROUPS = 2
PODS = GROUPS * 3  # 2 attention ranks + 1 FFN rank per group
METRICS_PORT = 9090
# what the attention ranks counted of their recovery (per pod; summed over every pod seen)
RECOVERY_SERIES = ("afd_requests_resumed_total", "afd_requests_hold_expired_total", "afd_requests_carried_total",
                   "afd_request_errors_total", "afd_request_hold_seconds_sum")


@dataclass
class Result:
    prompt: int
    started: float
    ended: float
    ok: bool
    detail: str = ""
    text: str = ""
    longest_gap: float = 0.0


def one_stream(client: httpx.Client, url: str, prompt: int) -> Result:
    """One streamed greedy completion; ok only when whole: 200, [DONE], no error, TOKENS tokens, one id."""
    body = {"model": SERVED, "prompt": PROMPTS[prompt], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.monotonic()
    times, text, ids, usage, events = [started], "", set(), None, []
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Result(prompt, started, time.monotonic(), False, f"HTTP {response.status_code}: {response.read()[:200]!r}")
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(prompt, started, time.monotonic(), False, f"error event: {chunk['error']}", text)
                ids.add(chunk["id"])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    times.append(time.monotonic())
                    text += choice["text"]
    except httpx.HTTPError as err:
        return Result(prompt, started, time.monotonic(), False, f"{type(err).__name__}: {err} after {len(times) - 1} chunks", text)
    ended = time.monotonic()
    gap = max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else 0.0
    if events[-1:] != ["[DONE]"]:
        return Result(prompt, started, ended, False, f"no [DONE]: {events[-2:]}", text, gap)
    if not usage or usage["completion_tokens"] != TOKENS or len(ids) != 1:
        return Result(prompt, started, ended, False, f"usage {usage}, ids {ids}", text, gap)
    return Result(prompt, started, ended, True, "", text, gap)


@dataclass
class Clients:
    """CLIENTS closed-loop streaming clients, client i asking prompt (i + k) % CLIENTS on its k-th request."""

    url: str
    results: list[Result] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> "Clients":
        for index in range(CLIENTS):
            self.threads.append(threading.Thread(target=self._client, args=(index,), daemon=True))
            self.threads[-1].start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(180)

    def _client(self, index: int) -> None:
        # the read timeout covers a request held while its FFN rank is replaced (AFD_FFN_HOLD_S, 60 s)
        with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
            k = 0
            while not self.stop.is_set():
                self.results.append(one_stream(client, self.url, (index + k) % CLIENTS))
                k += 1


def reference_texts(url: str) -> list[str]:
    """Every prompt once, all at the same time, nothing disturbed: the texts the soak must reproduce."""
    results: list[Result | None] = [None] * CLIENTS

    def ask(i):
        with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
            results[i] = one_stream(client, url, i)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert all(r is not None and r.ok for r in results), [r and r.detail for r in results]
    return [r.text for r in results]


def rank_pods(cluster: Cluster, namespace: str) -> list[dict]:
    return [p for p in cluster.list("Pod", namespace, selector=f"afd.io/name={NAME}")
            if p["metadata"].get("labels", {}).get("afd.io/role") in ("attention", "ffn")]


def all_ready(cluster: Cluster, namespace: str) -> bool:
    """Every rank pod of every group Running, Ready and not being deleted."""
    pods = [p for p in rank_pods(cluster, namespace) if not p["metadata"].get("deletionTimestamp")]
    ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                    for c in (p.get("status") or {}).get("conditions") or [])]
    return len(pods) == PODS and len(ready) == PODS


def _is_ready(pod: dict) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])


@dataclass
class Deletion:
    pod: str
    role: str
    uid: str
    restarts: int
    at: float
    how: str = "deleted"
    ready_after: float | None = None  # seconds until its replacement (new pod, or restarted container) was Ready


def _restarts(pod: dict) -> int:
    return sum(c.get("restartCount", 0) for c in (pod.get("status") or {}).get("containerStatuses") or [])


def kill_processes_of(pod: str) -> int:
    """SIGKILL every `afd` process of `pod` (found by the HOSTNAME the kubelet gives it), as a crash would."""
    killed = 0
    for proc in os.listdir("/proc"):
        if not proc.isdigit():
            continue
        try:
            with open(f"/proc/{proc}/environ", "rb") as env, open(f"/proc/{proc}/cmdline", "rb") as cmd:
                if f"HOSTNAME={pod}".encode() in env.read().split(b"\0") and b"afd" in cmd.read():
                    os.kill(int(proc), signal.SIGKILL)
                    killed += 1
        except (OSError, ProcessLookupError):
            continue
    return killed


def scrape_recovery(pods: list[dict]) -> dict[str, dict[str, float]]:
    """pod uid → RECOVERY_SERIES from each Ready attention pod's /metrics."""
    seen = {}
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if pod["metadata"]["labels"].get("afd.io/role") != "attention" or not ip or not _is_ready(pod):
            continue
        try:
            lines = httpx.get(f"http://{ip}:{METRICS_PORT}/metrics", timeout=2).text.splitlines()
        except httpx.HTTPError:
            continue
        seen[pod["metadata"]["uid"]] = {name: sum(float(line.split()[-1]) for line in lines
                                                  if line.startswith(name + " ") or line.startswith(name + "{"))
                                        for name in RECOVERY_SERIES}
    return seen


@dataclass
class Disruptor:
    """Every 30–60 s (on its own clock, whatever the pods' state) delete a random rank pod (attention or FFN, any
    group); meanwhile time each replacement until Ready, and how long no group had every rank Ready."""

    cluster: Cluster
    namespace: str
    seed: int
    deletions: list[Deletion] = field(default_factory=list)
    no_group_s: float = 0.0  # seconds in which no group had all its rank pods Ready
    kill_ffn: bool = False
    recovery: dict[str, dict[str, float]] = field(default_factory=dict)  # pod uid → its last scraped counters
    logs: str = os.environ.get("AFD_SOAK_LOGS", "")
    following: dict[tuple, subprocess.Popen] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, until: float) -> None:
        rng = random.Random(self.seed)
        next_at = time.monotonic() + rng.uniform(30, 60)
        last = scraped = time.monotonic()
        while not self.stop.is_set():
            now = time.monotonic()
            pods = rank_pods(self.cluster, self.namespace)
            self._watch(pods, now, now - last)
            self._follow_logs(pods)
            last = now
            if now - scraped >= 3:
                self.recovery.update(scrape_recovery(pods))
                scraped = now
            if now >= until and all(d.ready_after is not None for d in self.deletions):
                return
            if now < until and now >= next_at:
                self._delete_one(rng, pods)
                next_at += rng.uniform(30, 60)
            time.sleep(0.5)

    def _watch(self, pods: list[dict], now: float, elapsed: float) -> None:
        ready = {p["metadata"]["name"]: (p["metadata"]["uid"], _restarts(p)) for p in pods if _is_ready(p)}
        for d in self.deletions:
            uid, restarts = ready.get(d.pod, (d.uid, d.restarts))
            if d.ready_after is None and (uid != d.uid or restarts > d.restarts):
                d.ready_after = now - d.at
                print(f"[soak] {d.pod} Ready again {d.ready_after:.1f} s after its deletion", flush=True)
        groups = {}
        for p in pods:
            group = p["metadata"]["labels"].get("afd.io/group")
            groups[group] = groups.get(group, 0) + (p["metadata"]["name"] in ready)
        if not any(count == PODS // GROUPS for count in groups.values()):
            self.no_group_s += elapsed

    def _follow_logs(self, pods: list[dict]) -> None:
        if not self.logs:
            return
        os.makedirs(self.logs, exist_ok=True)
        for pod in pods:
            states = (pod.get("status") or {}).get("containerStatuses") or []
            if not states or "running" not in states[0].get("state", {}):
                continue
            key = (pod["metadata"]["name"], pod["metadata"]["uid"][:8], _restarts(pod))
            if key not in self.following:
                with open(os.path.join(self.logs, "%s-%s-%d.log" % key), "w") as out:
                    self.following[key] = subprocess.Popen(
                        ["kubectl", "--kubeconfig", str(self.cluster.kubeconfig), "-n", self.namespace, "logs", "-f",
                         "--timestamps", key[0]], stdout=out, stderr=subprocess.STDOUT)

    def _delete_one(self, rng: random.Random, pods: list[dict]) -> None:
        pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        roles = {d.role for d in self.deletions}
        if len(self.deletions) >= 2 and len(roles) == 1:  # both roles are hit at least once
            pods = [p for p in pods if p["metadata"]["labels"]["afd.io/role"] not in roles] or pods
        victim = rng.choice(sorted(pods, key=lambda p: p["metadata"]["name"]))
        meta = victim["metadata"]
        deletion = Deletion(meta["name"], meta["labels"]["afd.io/role"], meta["uid"], _restarts(victim), time.monotonic())
        if self.kill_ffn and deletion.role == "ffn" and kill_processes_of(meta["name"]):
            deletion.how = "killed"
        else:
            self.cluster.delete("Pod", meta["name"], self.namespace)
        self.deletions.append(deletion)
        print(f"[soak] {time.strftime('%H:%M:%S')} {deletion.how} {meta['name']}", flush=True)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def _latency(results: list[Result]) -> str:
    if not results:
        return "none"
    whole = [r.ended - r.started for r in results]
    gaps = [r.longest_gap for r in results]
    return (f"{len(results)} requests: whole p50 {statistics.median(whole):.2f} / p99 {_pct(whole, 0.99):.2f} / max "
            f"{max(whole):.2f} s; longest pause p50 {statistics.median(gaps):.2f} / p99 {_pct(gaps, 0.99):.2f} / "
            f"max {max(gaps):.2f} s")


def _during_waits(results: list[Result], deletions: list[Deletion]) -> tuple[list[Result], list[Result]]:
    """Requests that overlapped a wait (from a deletion until every pod was Ready again), and the rest."""
    windows = [(d.at, d.at + (d.ready_after if d.ready_after is not None else 600)) for d in deletions]
    during = [r for r in results if any(r.started < end and r.ended > start for start, end in windows)]
    return during, [r for r in results if r not in during]


def _operator_events(cluster: Cluster, namespace: str) -> list[str]:
    return [f"{e['reason']}: {e['message'][:160]}" for e in cluster.list("Event", namespace)
            if e.get("involvedObject", {}).get("kind") == "AFDDeployment"]


def _install_operator(cluster: Cluster, steps: Steps) -> HelmRelease:
    release = HelmRelease(cluster, "afd", cluster.new_namespace("afd-system"),
                          {"image": {"repository": OPERATOR_IMAGE.rsplit(":", 1)[0], "tag": "dev", "pullPolicy": "Never"},
                           "operator": {"resyncSeconds": 2}})
    steps.run("helm install", release.install)
    steps.run("operator pod Ready", eventually, lambda: _operator_ready(cluster, release.namespace), 300, "operator Ready", 1)
    return release


def _report(steps: Steps) -> None:
    print("\n" + steps.table())
    if report := os.environ.get("AFD_E2E_REPORT"):
        with open(report, "a") as out:
            out.write(steps.table() + "\n\n")


def test_rank_pods_deleted_every_30_to_60_s_lose_no_request_and_change_no_text(tmp_path_factory):
    cluster = node_cluster_or_skip()
    steps = Steps()
    if os.environ.get("AFD_E2E_REUSE_IMAGES") != "1":
        steps.run("build images and import them into the node", build_and_import_images)
    model_dir = steps.run("tiny model on the host", tiny_model_on_the_host, tmp_path_factory.mktemp("soak-model") / "tiny")
    soak_s = float(os.environ.get("AFD_SOAK_S", "300"))
    seed = int(os.environ.get("AFD_SOAK_SEED", "38"))
    release = _install_operator(cluster, steps)
    namespace = cluster.new_namespace("afd-soak")
    try:
        body = _sample(namespace, model_dir, replicas=GROUPS)
        body["spec"].pop("ratio")
        cluster.create(body)
        steps.run(f"apply the CPU sample, {GROUPS} groups of 2A1F; every rank pod Ready", eventually,
                  lambda: all_ready(cluster, namespace) and "6 rank pods Ready", 900, "every rank pod Ready", 1)
        url = service_url(cluster, namespace, NAME)
        steps.run("the Service answers", eventually, lambda: _answers(url), 60, "GET /health through the Service", 1)
        reference = steps.run("undisturbed run: 8 prompts at once", reference_texts, url)

        disruptor = Disruptor(cluster, namespace, seed, kill_ffn=os.environ.get("AFD_SOAK_KILL_FFN") == "1")
        with Clients(url) as clients:
            started = time.monotonic()
            thread = threading.Thread(target=disruptor.run, args=(started + soak_s,), daemon=True)
            thread.start()
            thread.join(soak_s + 900)
            disruptor.stop.set()
            steps.run("after the last deletion, every rank pod Ready", eventually,
                      lambda: all_ready(cluster, namespace) and "6 rank pods Ready", 600, "every rank pod Ready", 1)
            time.sleep(5)
        deletions = disruptor.deletions
        soaked = time.monotonic() - started
        results = clients.results
        failed = [r for r in results if not r.ok]
        unequal = [r for r in results if r.ok and r.text != reference[r.prompt]]
        during, rest = _during_waits([r for r in results if r.ok], deletions)
        waits = [d.ready_after for d in deletions if d.ready_after is not None]
        steps.rows.append((f"soak: {CLIENTS} streaming greedy clients, {TOKENS} tokens each, a rank pod deleted every "
                           f"30-60 s (seed {seed})", soaked,
                           f"{len(results) - len(failed)} ok, {len(failed)} failed; {len(unequal)} texts unequal"))
        steps.rows.append(("deletions", 0.0, ", ".join(f"{d.pod} {d.how} ({d.ready_after:.1f} s)"
                                                        if d.ready_after is not None else f"{d.pod} (not Ready again)"
                                                        for d in deletions)))
        steps.rows.append(("no group with every rank Ready", disruptor.no_group_s, ""))
        counted = {name: sum(c[name] for c in disruptor.recovery.values()) for name in RECOVERY_SERIES}
        steps.rows.append(("attention ranks' recovery counters (every pod seen, last scrape)", 0.0,
                           ", ".join(f"{name} {value:g}" for name, value in counted.items())))
        if waits:
            steps.rows.append(("until the deleted pod's replacement was Ready", 0.0,
                               f"p50 {statistics.median(waits):.1f} / p99 {_pct(waits, 0.99):.1f} / max {max(waits):.1f} s"))
        steps.rows.append(("requests during the waits", 0.0, _latency(during)))
        steps.rows.append(("requests outside them", 0.0, _latency(rest)))
        for event in _operator_events(cluster, namespace):
            print(f"[soak] event {event}")
        assert deletions and {d.role for d in deletions} == {"attention", "ffn"}, [d.pod for d in deletions]
        assert not failed, f"{len(failed)} of {len(results)} failed:\n" + "\n".join(
            f"{PROMPTS[r.prompt]!r} at +{r.started - started:.1f} s: {r.detail}" for r in failed[:12])
        assert not unequal, [(r.prompt, r.text, reference[r.prompt]) for r in unequal[:4]]
        assert len(results) >= CLIENTS * 10
    finally:
        release.uninstall()
        cluster.delete("Namespace", namespace)
        cluster.delete("Namespace", release.namespace)
        _report(steps)


@pytest.mark.parametrize("arch, sample", [("deepseek_v3", "cpu-zmq-tiny-deepseek-v3.yaml"),
                                          ("deepseek_v32", "cpu-zmq-tiny-deepseek-v32.yaml")])
def test_the_tiny_deepseek_v3_sample_answers_through_its_client_service(arch, sample, tmp_path_factory):
    """crds/samples/cpu-zmq-tiny-deepseek-v3.yaml (and the V3.2 one: sparse attention past 16 tokens) as written
    (2A1F, the gate on the attention ranks), with the image and a host-path tiny model of its arch: Ready, then a
    completion and a stream through the Service."""
    import copy

    import yaml

    from op_testkit import SAMPLES
    from test_real_node_e2e import _ask

    cluster = node_cluster_or_skip()
    steps = Steps()
    if os.environ.get("AFD_E2E_REUSE_IMAGES") != "1":
        steps.run("build images and import them into the node", build_and_import_images)
    model_dir = steps.run(f"afd make-tiny-model --arch {arch} on the host", tiny_model_on_the_host,
                          tmp_path_factory.mktemp("model") / f"tiny-{arch}", arch)
    release = _install_operator(cluster, steps)
    namespace = cluster.new_namespace("afd-v3")
    try:
        body = copy.deepcopy(yaml.safe_load(next(p for p in SAMPLES if p.name == sample).read_text()))
        name = body["metadata"]["name"]
        body["metadata"]["namespace"] = namespace
        body["spec"].update(image=RUNTIME_IMAGE, imagePullPolicy="Never", servedModelName=SERVED)
        body["spec"]["model"] = {"uri": str(model_dir)}
        cluster.create(body)

        def ready():
            status = (cluster.get("AFDDeployment", name, namespace) or {}).get("status") or {}
            conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
            return conditions.get("Ready") == "True" and status.get("groupsReady") == "1/1" and "groups 1/1"

        steps.run(f"apply the {sample} sample; Ready 1/1", eventually, ready, 900, f"{name} Ready", 1)
        url = service_url(cluster, namespace, name)
        steps.run("the Service answers", eventually, lambda: _answers(url), 60, "GET /health through the Service", 1)
        steps.run("completion and stream through the client Service", _ask, url)
    finally:
        release.uninstall()
        cluster.delete("Namespace", namespace)
        cluster.delete("Namespace", release.namespace)
        _report(steps)
