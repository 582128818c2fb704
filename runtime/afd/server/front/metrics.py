"""Metrics of `afd up`'s front door, and one exposition merging every rank's with them.

Like vLLM's API port, the front door answers `/metrics`: its own series (requests relayed
by status class, requests in flight, which rank could be scraped) followed by every
rank's series. Ranks label their series `role` and `rank`, so the merge only has to join
families that several ranks export (one HELP/TYPE block each, as the format requires).
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

STATUS_CLASSES = ("2xx", "4xx", "5xx", "client_gone")


class FrontMetrics:
    """`afd_front_requests_total{status}`, `afd_front_requests_in_flight`, `afd_front_scrape_up{target}`."""

    def __init__(self, in_flight: Callable[[], int], targets: Iterable[str]):
        self.registry = CollectorRegistry()
        self.requests = Counter("afd_front_requests", "Requests relayed by the front door, by answer",
                                ["status"], registry=self.registry)
        for status in STATUS_CLASSES:  # every series exists from the start (0, not "No data")
            self.requests.labels(status=status)
        Gauge("afd_front_requests_in_flight", "Requests the front door is relaying now",
              registry=self.registry).set_function(in_flight)
        self.scrape_up = Gauge("afd_front_scrape_up", "1 if the rank's /metrics answered the last merge",
                               ["target"], registry=self.registry)
        for target in targets:
            self.scrape_up.labels(target=target)
        self.moves = Counter("afd_front_requests_moved", "Streams moved to another attention rank after theirs was "
                             "lost mid-stream", registry=self.registry)
        self.move_wait = Histogram("afd_front_move_wait_seconds", "From a stream's cut to another rank's answer",
                                   buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=self.registry)

    def moved(self, seconds: float) -> None:
        """A stream moved to another rank after waiting `seconds`."""
        self.moves.inc()
        self.move_wait.observe(seconds)

    def count(self, status: int | None) -> None:
        """One relayed request; None when the client left before the answer."""
        self.requests.labels(status="client_gone" if status is None else f"{min(status // 100, 5)}xx").inc()

    def exposition(self, rank_texts: dict[str, str | None]) -> bytes:
        """Our series, then every rank's (`None`: that rank did not answer)."""
        for target, text in rank_texts.items():
            self.scrape_up.labels(target=target).set(0 if text is None else 1)
        own = generate_latest(self.registry).decode()
        return merge_expositions([own, *(t for t in rank_texts.values() if t)])


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge_expositions(texts: Iterable[str]) -> bytes:
    """Prometheus text expositions joined into one, each metric family once."""
    merged: dict[str, object] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name in merged:
                merged[family.name].samples.extend(family.samples)
            else:
                merged[family.name] = family
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
