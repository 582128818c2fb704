"""What `afd up` prints: few waiting lines while ranks start, and a word on the demo model's random weights
(issue 35 items 9 and 10)."""

from types import SimpleNamespace

import pytest

import afd.local.up
from afd.config import AFDConfig
from afd.local.up_messages import RANDOM_WEIGHTS_NOTE, WaitReport


class Clock:
    """A stand-in for `time` in afd.local.up: sleeping moves it on at once."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_waiting_for_ranks_says_what_changed_not_the_same_line_again(monkeypatch):
    """Two attention ranks ready after 20 s and 95 s: five lines, not one every 5 s."""
    clock, said = Clock(), []
    ranks = afd.local.up.plan_ranks(AFDConfig(num_attention_ranks=2, num_ffn_ranks=1, model="m"))
    supervisor = afd.local.up.Supervisor(ranks, SimpleNamespace(children={}), None, "http://127.0.0.1:1/v1")
    first, second = supervisor.attention_urls()
    ready_at = {first: clock.now + 20, second: clock.now + 95}
    monkeypatch.setattr(afd.local.up, "time", clock)
    monkeypatch.setattr(afd.local.up, "progress", said.append)
    monkeypatch.setattr(afd.local.up.httpx, "get",
                        lambda url, timeout: SimpleNamespace(status_code=200 if clock.now >= ready_at[url[:-7]] else 503))
    supervisor.wait_healthy(timeout_s=600)
    assert said == ["waiting for 2 attention rank(s) to load, connect and warm up",
                    "1 of 2 attention rank(s) ready, still waiting (20 s)",
                    "1 of 2 attention rank(s) ready, still waiting (50 s)",
                    "1 of 2 attention rank(s) ready, still waiting (80 s)",
                    "all 2 attention rank(s) ready after 95 s"]


def test_a_rank_ready_at_once_gets_no_waiting_line():
    report = WaitReport(1, 0.0)
    assert report.update(0, 0.0) is None


@pytest.mark.parametrize("default_model", [True, False])
def test_the_demo_answer_says_when_the_weights_are_random(default_model, tmp_path, monkeypatch):
    said = []
    model = tmp_path / "cache" / "tiny-qwen3_moe" if default_model else tmp_path / "my-checkpoint"
    reply = {"choices": [{"message": {"content": "\ufffdP\x1b once7>fplits"}}], "usage": {"completion_tokens": 24}}
    posted = []
    monkeypatch.setenv("AFD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(afd.local.up, "progress", said.append)
    monkeypatch.setattr(afd.local.up.httpx, "post", lambda url, json, timeout, headers=None: posted.append(json) or SimpleNamespace(json=lambda: reply))
    afd.local.up._demo_request("http://127.0.0.1:1/v1", str(model), SimpleNamespace(started=True))
    assert posted[0]["model"] == model.name  # the served model's name, as /v1/models lists it
    assert said[0].startswith("demo request answered (24 tokens): ") and said[-1].startswith("ready: ")
    assert (RANDOM_WEIGHTS_NOTE in said) == default_model and "random weights" in RANDOM_WEIGHTS_NOTE


def test_the_readme_first_screen_says_the_demo_model_is_random():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    make_up = next(line for line in readme.splitlines() if line.startswith("make up"))
    assert "random weights" in make_up and "noise" in make_up
