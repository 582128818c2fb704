"""Scrape the ranks' /metrics for `afd plan` (the side effects: HTTP and the clock)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import httpx

from afd.planner.samples import RankSample, parse_exposition


class ScrapeError(RuntimeError):
    """A rank's metrics could not be read; the text names the URL."""


def urls_from_state_file(path: str | Path) -> list[str]:
    """Every rank's metrics URL from the JSON state file `afd up --state-file` keeps."""
    try:
        state = json.loads(Path(path).read_text())
        return [rank["metrics"] for rank in state["ranks"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ScrapeError(f"--state-file {path}: not an `afd up` state file ({err})") from None


def scrape_once(urls: list[str], timeout_s: float = 5.0) -> list[RankSample]:
    samples = []
    with httpx.Client(timeout=timeout_s) as client:
        for url in urls:
            at = time.time()
            try:
                reply = client.get(url)
                reply.raise_for_status()
            except httpx.HTTPError as err:
                raise ScrapeError(f"{url}: {err}") from None
            samples += parse_exposition(reply.text, at)
    return samples


def scrape_series(urls: list[str], count: int, interval_s: float,
                  progress: Callable[[str], None] = lambda _: None) -> list[list[RankSample]]:
    """`count` scrapes of every URL, `interval_s` apart."""
    scrapes = []
    for index in range(count):
        if index:
            time.sleep(interval_s)
        scrapes.append(scrape_once(urls))
        progress(f"scrape {index + 1}/{count}: {len(scrapes[-1])} ranks")
    return scrapes
