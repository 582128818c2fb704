"""The autoscaling feed: what it reads (attention ranks' /metrics or Prometheus), when, what it
keeps, and the drain call."""

from __future__ import annotations

from afd_operator.model.spec import parse_spec
from afd_operator.groups.observe import PodFacts, format_time
from afd_operator.autoscaler.feed import ServiceFeed
from op_testkit import make_cr

T0 = 1_800_000_000.0
AUTOSCALING = {"enabled": True, "targets": {"waitingPerGroup": 4}, "sampleIntervalSeconds": 15,
               "scaleDownWindowSeconds": 60}


def pods_of(body, group):
    revision = parse_spec(body["spec"]).revision
    return [PodFacts(f"demo-g{group}-attn-{r}", group, "attention", revision, "Running", True, 0, T0,
                     ip=f"10.0.{group}.{r}") for r in range(2)] + [
        PodFacts(f"demo-g{group}-ffn-0", group, "ffn", revision, "Running", True, 0, T0, ip=f"10.0.{group}.9")]


class Ranks:
    def __init__(self):
        self.asked = []

    def get(self, url):
        self.asked.append(url)
        rank = url.split("/")[2].split(":")[0].rsplit(".", 1)[1]
        return f'afd_requests_waiting{{role="attention",rank="{rank}"}} 2\n'


def test_reads_the_attention_ranks_each_interval_and_keeps_the_scale_down_window():
    body, ranks = make_cr(autoscaling=AUTOSCALING), Ranks()
    feed = ServiceFeed(ranks.get)
    pods = pods_of(body, 0)
    assert feed.collect(body, pods, T0) == {}  # one scrape: no interval yet
    assert sorted(ranks.asked) == ["http://10.0.0.0:9090/metrics", "http://10.0.0.1:9090/metrics"]  # never the FFN
    feed.collect(body, pods, T0 + 5)  # not due
    assert len(ranks.asked) == 2
    for k in range(1, 8):
        kept = feed.collect(body, pods, T0 + 15 * k)
    assert [s.at for s in kept[0]] == [T0 + 15 * k for k in range(2, 8)]  # 60 s window + one interval
    assert kept[0][-1].waiting == 4


def test_a_draining_group_is_read_at_every_reconcile_and_nothing_when_autoscaling_is_off():
    body, ranks = make_cr(autoscaling=AUTOSCALING), Ranks()
    body["status"] = {"groups": [{"index": 1, "drainingSince": format_time(T0)}]}
    feed = ServiceFeed(ranks.get)
    pods = pods_of(body, 0) + pods_of(body, 1)
    feed.collect(body, pods, T0)
    feed.collect(body, pods, T0 + 1)
    assert sum("10.0.1." in url for url in ranks.asked) == 4 and sum("10.0.0." in url for url in ranks.asked) == 2
    off = make_cr(autoscaling={"enabled": False})
    assert ServiceFeed(ranks.get).collect(off, pods, T0) == {} and len(ranks.asked) == 6


def test_reads_prometheus_when_a_url_is_set():
    body = make_cr(autoscaling={**AUTOSCALING, "prometheusURL": "http://prom:9090"})
    asked = []

    def prometheus(url, labels, at):
        asked.append((url, labels))
        return 'afd_requests_waiting{role="attention",rank="0"} 3\n'
    feed = ServiceFeed(lambda url: (_ for _ in ()).throw(AssertionError("no pod is read")), prometheus)
    feed.collect(body, pods_of(body, 0), T0)
    kept = feed.collect(body, pods_of(body, 0), T0 + 15)
    assert asked[0] == ("http://prom:9090", {"afd_io_name": "demo", "afd_io_group": "0", "namespace": "ns"})
    assert kept[0][-1].waiting == 3


def test_drain_calls_the_ranks_drain_endpoint_at_once_and_survives_a_refusal():
    asked = []

    def get(url):
        asked.append(url)
        raise OSError("connection refused")
    pod = PodFacts("demo-g1-attn-0", 1, "attention", "r", "Running", True, 0, T0, ip="fd00::5")
    ServiceFeed(get).drain(pod, 9090)
    assert asked == ["http://[fd00::5]:9090/drain?seconds=0"]


def test_the_drain_call_turns_a_real_probe_server_unready_at_once_while_it_serves_on():
    """The contract with the runtime (afd.server.probe_http): /drain?seconds=0 answers at once,
    and readiness is 503 from then on."""
    import time
    import urllib.error
    import urllib.request

    from prometheus_client import CollectorRegistry

    from afd.server.probe_http import Probes, start_probe_server

    probes = Probes(lambda: None)
    server = start_probe_server("127.0.0.1", 0, probes, CollectorRegistry())
    try:
        port = server.server_address[1]
        pod = PodFacts("demo-g1-attn-0", 1, "attention", "r", "Running", True, 0, T0, ip="127.0.0.1")
        started = time.monotonic()
        ServiceFeed().drain(pod, port)
        assert time.monotonic() - started < 2.0
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            raise AssertionError("still ready after the drain")
        except urllib.error.HTTPError as err:
            assert err.code == 503 and b"draining" in err.read()
    finally:
        server.shutdown()
