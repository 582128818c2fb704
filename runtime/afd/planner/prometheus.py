"""The series `afd plan` needs, read from a Prometheus HTTP API instead of the ranks.

A PodMonitor of an AFDDeployment labels every series with `afd_io_name` and `afd_io_group`
(and Prometheus adds `namespace`), so one group's ranks are one selector. Prometheus keeps
history: the scrapes are instant queries at past times, so a plan needs no waiting. The
answer is written back as exposition text and parsed by `samples.parse_exposition`, the one
parser of these series. Standard library only (the operator uses it too).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from afd.planner.samples import RankSample, parse_exposition

SERIES = ("afd_step_duration_seconds_sum", "afd_step_duration_seconds_count", "afd_step_tokens_sum",
          "afd_step_tokens_count", "afd_layer_compute_seconds_sum", "afd_layer_compute_seconds_count",
          "afd_transfer_seconds_sum", "afd_transfer_seconds_count", "afd_generation_tokens_total", "afd_group_info")


class PrometheusError(RuntimeError):
    """Prometheus did not answer, or refused the query; the text names the URL."""


def selector(deployment: str, group: int, namespace: str | None = None) -> dict[str, str]:
    """The labels of one group's series (what the PodMonitor's podTargetLabels become)."""
    labels = {"afd_io_name": deployment, "afd_io_group": str(group)}
    return labels | ({"namespace": namespace} if namespace else {})


def query_text(labels: dict[str, str]) -> str:
    matchers = [f'__name__=~"{"|".join(SERIES)}"'] + [f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())]
    return "{" + ",".join(matchers) + "}"


def scrape_at(url: str, labels: dict[str, str], at: float, timeout_s: float = 10.0) -> list[RankSample]:
    """The group's counters as Prometheus saw them at `at` (epoch seconds)."""
    query = urllib.parse.urlencode({"query": query_text(labels), "time": f"{at:.3f}"})
    endpoint = f"{url.rstrip('/')}/api/v1/query?{query}"
    try:
        with urllib.request.urlopen(endpoint, timeout=timeout_s) as reply:
            answer = json.loads(reply.read())
    except urllib.error.HTTPError as err:
        raise PrometheusError(f"{url}: HTTP {err.code}: {err.read()[:300].decode(errors='replace')}") from None
    except (OSError, ValueError) as err:
        raise PrometheusError(f"{url}: {err}") from None
    if answer.get("status") != "success" or answer.get("data", {}).get("resultType") != "vector":
        raise PrometheusError(f"{url}: query refused: {answer.get('error', answer)}")
    return parse_exposition(exposition(answer["data"]["result"]), at)


def scrape_history(url: str, labels: dict[str, str], count: int, interval_s: float, now: float) -> list[list[RankSample]]:
    """`count` scrapes, `interval_s` apart, the last at `now` (oldest first); empty ones dropped."""
    scrapes = [scrape_at(url, labels, now - interval_s * (count - 1 - i)) for i in range(count)]
    return [s for s in scrapes if s]


def exposition(result: list[dict]) -> str:
    """An instant vector as exposition text."""
    lines = []
    for series in result:
        metric = dict(series["metric"])
        name = metric.pop("__name__")
        labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(metric.items()))
        lines.append(f"{name}{{{labels}}} {series['value'][1]}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
