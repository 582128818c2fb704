"""Where spec.autoscaling's serving samples come from, and the drain call (the side effects).

Every `autoscaling.sampleIntervalSeconds` the feed reads each group whose attention pods all
run: every attention rank's /metrics on its pod IP and metrics port, or, with
`autoscaling.prometheusURL`, the same series from Prometheus (an instant query per group, the
PodMonitor's `afd_io_name`/`afd_io_group` labels, as spec.ratio's feed does). A draining group is
read at every reconcile, so that its deletion follows its last request closely. It keeps each
group's scrapes of the last scale-down window (at least two). A group that cannot be read is skipped this round and logged.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Mapping, Sequence

from afd.planner.prometheus import PrometheusError, exposition, selector
from afd_operator.model.spec import SpecError, parse_spec
from afd_operator.groups.observe import PodFacts
from afd_operator.ratio.feed import http_get
from afd_operator.autoscaler.signals import SERIES, ServiceSample, parse_service

log = logging.getLogger(__name__)
History = Sequence[ServiceSample]  # one group's scrapes, oldest first


def prometheus_sample(url: str, labels: Mapping[str, str], at: float, timeout_s: float = 10.0) -> str:
    """The group's serving series as Prometheus saw them at `at`, as exposition text."""
    matchers = [f'__name__=~"{"|".join(SERIES)}"'] + [f'{k}="{v}"' for k, v in sorted(labels.items())]
    query = urllib.parse.urlencode({"query": "{" + ",".join(matchers) + "}", "time": f"{at:.3f}"})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query?{query}", timeout=timeout_s) as reply:
            answer = json.loads(reply.read())
    except urllib.error.HTTPError as err:
        raise PrometheusError(f"{url}: HTTP {err.code}") from None
    except (OSError, ValueError) as err:
        raise PrometheusError(f"{url}: {err}") from None
    if answer.get("status") != "success" or answer.get("data", {}).get("resultType") != "vector":
        raise PrometheusError(f"{url}: query refused: {answer.get('error', answer)}")
    return exposition(answer["data"]["result"])


def draining_groups(status: Mapping[str, Any]) -> set[int]:
    return {int(g["index"]) for g in status.get("groups") or [] if g.get("drainingSince")}


class ServiceFeed:
    """Recent serving samples per resource (uid) and group, for `reconcile(..., service=)`."""

    def __init__(self, get: Callable[[str], str] = http_get,
                 prometheus: Callable[[str, Mapping[str, str], float], str] = prometheus_sample) -> None:
        self._get, self._prometheus = get, prometheus
        self._samples: dict[str, dict[int, list[ServiceSample]]] = {}
        self._last: dict[str, float] = {}

    def collect(self, body: Mapping[str, Any], pods: list[PodFacts], now: float) -> dict[int, History]:
        meta = body.get("metadata") or {}
        uid = meta.get("uid", "")
        try:
            spec = parse_spec(body.get("spec"))
        except SpecError:
            return {}
        draining = draining_groups(body.get("status") or {})
        if not spec.autoscaling.enabled and not draining:
            self.forget(uid)
            return {}
        kept = self._samples.setdefault(uid, {})
        due = now - self._last.get(uid, float("-inf")) >= spec.autoscaling.sample_interval_seconds
        if due:
            self._last[uid] = now
        for index, attention in _serving_groups(pods).items():
            if not (due or index in draining):
                continue
            try:
                text = (self._prometheus(spec.autoscaling.prometheus_url, selector(meta["name"], index, meta.get("namespace")), now)
                        if spec.autoscaling.prometheus_url else self._scrape(attention, spec.ports.metrics))
            except (OSError, ValueError, PrometheusError) as err:
                log.warning("spec.autoscaling: cannot read the metrics of %s group %d: %s", meta.get("name"), index, err)
                continue
            sample = parse_service(text, now)
            if sample is not None:
                kept[index] = kept.get(index, []) + [sample]
        span = spec.autoscaling.scale_down_window_seconds + spec.autoscaling.sample_interval_seconds
        for index in list(kept):
            if index not in {p.group for p in pods}:
                del kept[index]
            else:  # the scale-down window's scrapes, and always the last two
                kept[index] = [s for i, s in enumerate(kept[index]) if s.at >= now - span or i >= len(kept[index]) - 2]
        return {index: list(s) for index, s in kept.items() if len(s) >= 2}

    def drain(self, pod: PodFacts, port: int) -> None:
        """Ask one attention rank to turn unready and finish what it runs (its preStop endpoint, at once)."""
        host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
        try:
            self._get(f"http://{host}:{port}/drain?seconds=0")
            log.info("spec.autoscaling: draining %s", pod.name)
        except (OSError, ValueError) as err:  # the next reconcile retries while the pod is Ready
            log.warning("spec.autoscaling: cannot drain %s: %s", pod.name, err)

    def forget(self, uid: str) -> None:
        self._samples.pop(uid, None)
        self._last.pop(uid, None)

    def _scrape(self, attention: list[PodFacts], port: int) -> str:
        texts = []
        for pod in attention:
            host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
            texts.append(self._get(f"http://{host}:{port}/metrics"))
        return "\n".join(texts)


def _serving_groups(pods: list[PodFacts]) -> dict[int, list[PodFacts]]:
    """Groups whose attention pods all run and have an IP: group → those pods."""
    groups: dict[int, list[PodFacts]] = {}
    for pod in pods:
        if pod.role == "attention":
            groups.setdefault(pod.group, []).append(pod)
    return {index: members for index, members in sorted(groups.items())
            if all(p.phase == "Running" and p.ip and not p.deleting for p in members)}

