"""Where spec.ratio's metric samples come from (the side effects: HTTP and the clock).

Every `ratio.sampleIntervalSeconds` the feed reads each group at the update revision whose
pods all run: every rank's /metrics on its pod IP and metrics port, or, with
`ratio.prometheusURL`, the same series from Prometheus (`afd.planner.prometheus`). It keeps
the last `ratio.samples` scrapes per group and forgets them when the group's revision
changes. A group that cannot be read is skipped this round and logged; reconcile goes on.
"""

from __future__ import annotations

import logging
import urllib.request
from typing import Any, Callable, Mapping

from afd.planner.prometheus import PrometheusError, scrape_at, selector
from afd.planner.samples import RankSample, parse_exposition
from afd_operator.model.spec import SpecError, parse_spec
from afd_operator.groups.observe import PodFacts
from afd_operator.ratio.recommend import Scrapes, effective_spec

log = logging.getLogger(__name__)


def http_get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return reply.read().decode()


class RatioFeed:
    """Recent scrapes per resource (uid) and group, for `reconcile(..., scrapes=)`."""

    def __init__(self, get: Callable[[str], str] = http_get) -> None:
        self._get = get
        self._scrapes: dict[str, dict[int, tuple[str, Scrapes]]] = {}  # uid → group → (revision, scrapes)
        self._last: dict[str, float] = {}

    def collect(self, body: Mapping[str, Any], pods: list[PodFacts], now: float) -> dict[int, Scrapes]:
        """Scrape when due; the scrapes kept for this resource, per group."""
        meta = body.get("metadata") or {}
        uid = meta.get("uid", "")
        try:
            spec = effective_spec(parse_spec(body.get("spec")), body.get("status") or {})
        except SpecError:
            return {}
        if spec.ratio.mode == "Off":
            self.forget(uid)
            return {}
        kept = self._scrapes.setdefault(uid, {})
        if now - self._last.get(uid, float("-inf")) >= spec.ratio.sample_interval_seconds:
            self._last[uid] = now
            for index, group_pods in _running_groups(pods, spec.revision, spec.topology.num_attention
                                                     + spec.topology.num_ffn).items():
                try:
                    scrape = (scrape_at(spec.ratio.prometheus_url, selector(meta["name"], index, meta.get("namespace")), now)
                              if spec.ratio.prometheus_url else self._scrape_pods(group_pods, spec.ports.metrics, now))
                except (OSError, ValueError, PrometheusError) as err:
                    log.warning("spec.ratio: cannot read the metrics of %s group %d: %s", meta.get("name"), index, err)
                    continue
                revision, old = kept.get(index, (spec.revision, []))
                history = old if revision == spec.revision else []
                kept[index] = (spec.revision, (history + [scrape])[-spec.ratio.samples:])
            for index in set(kept) - {p.group for p in pods}:
                del kept[index]
        return {index: scrapes for index, (revision, scrapes) in kept.items() if revision == spec.revision}

    def forget(self, uid: str) -> None:
        self._scrapes.pop(uid, None)
        self._last.pop(uid, None)

    def _scrape_pods(self, pods: list[PodFacts], port: int, now: float) -> list[RankSample]:
        samples: list[RankSample] = []
        for pod in pods:
            host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip  # IPv6
            samples += parse_exposition(self._get(f"http://{host}:{port}/metrics"), now)
        return samples


def _running_groups(pods: list[PodFacts], revision: str, ranks: int) -> dict[int, list[PodFacts]]:
    """Groups at `revision` whose every rank runs and has an IP."""
    groups: dict[int, list[PodFacts]] = {}
    for pod in pods:
        groups.setdefault(pod.group, []).append(pod)
    return {index: members for index, members in sorted(groups.items())
            if len(members) == ranks and all(p.revision == revision and p.phase == "Running" and p.ip
                                             and not p.deleting for p in members)}
