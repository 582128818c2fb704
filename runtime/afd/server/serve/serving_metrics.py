"""Serving metrics of an attention rank (the vLLM set, named `afd_<thing>_<unit>`)."""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from afd.metrics.histogram_buckets import LATENCY_BUCKETS, TOKEN_BUCKETS

_HOLD_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class ServingMetrics:
    """Engine observer feeding Prometheus; labels are only role and rank.

    The running, waiting and KV-cache gauges are read from the engine at scrape time
    (`track`), so they are current after every admission, finish and abort, not only
    after a step.
    """

    def __init__(self, registry: CollectorRegistry, rank: int, role: str = "attention"):
        labels = {"role": role, "rank": str(rank)}
        names = list(labels)

        def make(kind, name, doc, **kw):
            return kind(name, doc, names, registry=registry, **kw).labels(**labels)

        self.running = make(Gauge, "afd_requests_running", "Requests in the running batch")
        self.waiting = make(Gauge, "afd_requests_waiting", "Requests waiting for admission")
        self.ttft = make(Histogram, "afd_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS)
        self.itl = make(Histogram, "afd_inter_token_latency_seconds", "Time between two tokens of a request", buckets=LATENCY_BUCKETS)
        self.prompt_tokens = make(Counter, "afd_prompt_tokens", "Prompt tokens prefilled (a prompt the choices of "
                                  "one request share, once)")
        self.generation_tokens = make(Counter, "afd_generation_tokens", "Tokens generated")
        self.kv_usage = make(Gauge, "afd_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use")
        self.kv_capacity = make(Gauge, "afd_kv_cache_capacity_tokens", "Tokens the KV cache holds")
        self.kv_bytes = make(Gauge, "afd_kv_cache_bytes", "Device bytes of the KV cache's tensors, in their dtype "
                             "(kv_cache_dtype: FP8 holds twice the tokens of bf16 in the same bytes)")
        self.kv_token_bytes = make(Gauge, "afd_kv_cache_token_bytes", "KV-cache bytes one token takes, all layers")
        self.step_duration = make(Histogram, "afd_step_duration_seconds", "Wall time of one engine step", buckets=LATENCY_BUCKETS)
        self.step_tokens = make(Histogram, "afd_step_tokens", "Tokens computed in one step", buckets=TOKEN_BUCKETS)
        self.request_errors = make(Counter, "afd_request_errors", "Requests ended by an error")
        self.resumed = make(Counter, "afd_requests_resumed", "Requests held through the loss of their FFN rank that went on "
                            "once it was back (AFD_FFN_HOLD_S)")
        self.hold_expired = make(Counter, "afd_requests_hold_expired", "Held requests that failed: their FFN rank was not "
                                 "back within AFD_FFN_HOLD_S")
        self.hold_wait = make(Histogram, "afd_request_hold_seconds", "How long each resumed request waited for its FFN "
                              "rank", buckets=_HOLD_BUCKETS)
        self.carried = make(Counter, "afd_requests_carried", "Requests moved here from a lost attention rank, going on "
                            "after the tokens their client already had")
        self.prefill_cap = make(Gauge, "afd_prefill_cap_tokens",
                                "Prompt tokens the last step with decodes could take (prefill_itl_ratio); 0: uncapped")
        self._prefills_counted = weakref.WeakSet()  # the requests whose prefill afd_prompt_tokens has counted
        self._registry, self._labels = registry, labels

    def on_token(self, request, now: float) -> None:
        if request.first_token_at is None:
            self.ttft.observe(now - request.arrival)
            self._count_prompt(request.shares or request)
        else:
            self.itl.observe(now - request.last_token_at)
        self.generation_tokens.inc()

    def _count_prompt(self, prefilled) -> None:
        """Count the prompt of the request that fed it once, at the first token it gave: its own, or, when it was
        aborted with its last chunk's step unread, the first of its riders' (they fed none)."""
        if prefilled not in self._prefills_counted:
            self._prefills_counted.add(prefilled)
            self.prompt_tokens.inc(len(prefilled.prompt_ids))

    def track(self, engine) -> None:
        """Read the gauges from `engine` whenever Prometheus scrapes."""
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)
        self.kv_usage.set_function(lambda: engine.kv_cache.usage)
        self.kv_capacity.set(engine.kv_cache.capacity_tokens)
        if hasattr(engine.kv_cache, "nbytes"):  # the cache's tensors are in this process
            self.kv_bytes.set(engine.kv_cache.nbytes)
            self.kv_token_bytes.set(engine.kv_cache.token_bytes)
        self._registry.register(PrefixCacheCounts(engine.scheduler.prefix_counts, self._labels))
        pacer = engine.pacer
        self.prefill_cap.set_function(lambda: (pacer.last_cap or 0) if pacer is not None else 0)

    def on_step(self, engine, tokens: int, seconds: float) -> None:
        self.step_duration.observe(seconds)
        self.step_tokens.observe(tokens)

    def on_resumed(self, requests: int, waited_s: float) -> None:
        self.resumed.inc(requests)
        for _ in range(requests):
            self.hold_wait.observe(waited_s)

    def on_hold_expired(self, requests: int) -> None:
        self.hold_expired.inc(requests)

    def on_carried(self) -> None:
        self.carried.inc()

    def on_error(self) -> None:
        self.request_errors.inc()


class PrefixCacheCounts:
    """The scheduler's prefix-cache counts (`afd.engine.scheduling.prefix_hits.PrefixCounts`), read when scraped."""

    def __init__(self, counts, labels: dict[str, str]):
        self.counts, self.labels = counts, labels

    def describe(self) -> list:
        return []  # collected at scrape time only

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        queries = CounterMetricFamily("afd_prefix_cache_queries", "Prompt tokens of the requests admitted while "
                                      "prefix caching is on (looked up in the prefix cache)", labels=names)
        queries.add_metric(values, self.counts.queries)
        hits = CounterMetricFamily("afd_prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                   "prefilled again)", labels=names)
        hits.add_metric(values, self.counts.hits)
        return [queries, hits]
