"""`afd plan`'s cost model and recommendation on synthetic metric streams (pure), and the command."""

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest

from afd.planner.advice import Bounds, TooFewMetrics, plan
from afd.planner.cost import Line
from afd.planner.samples import parse_exposition
from afd.planner.prometheus import PrometheusError, scrape_at, scrape_history, selector
from afd.planner.simulate import FakePrometheus
from afd.planner.simulate import SimulatedGroup as Group
from afd.config.topology import Topology


def test_a_line_needs_two_loads_to_have_a_slope():
    assert Line.fit([(10, 1.0), (10.5, 1.2)]) == Line(1.1, 0.0, False)
    line = Line.fit([(10, 2.0), (20, 3.0), (40, 5.0)])
    assert line.varied and line.slope == pytest.approx(0.1) and line.intercept == pytest.approx(1.0)


def test_the_fit_recovers_the_costs_and_predicts_the_current_topology():
    result = plan(Group("2A1F").scrapes([16, 32, 64, 48]))
    model = result["model"]
    assert model["attention"]["slope_s_per_token"] == pytest.approx(1e-4, rel=1e-3)
    assert model["ffn"]["intercept_s"] == pytest.approx(1e-3, rel=1e-3)
    assert model["ffn"]["slope_s_per_token"] == pytest.approx(2e-5, rel=1e-3)
    assert result["current"] == "2A1F" and result["prediction_error"] < 0.01


def test_attention_bound_group_is_told_to_add_attention_ranks():
    slow_attention = dict(attention=(2e-3, 8e-4), ffn=(1e-3, 1e-5))
    result = plan(Group("1A1F", **slow_attention).scrapes([16, 32, 64]), Bounds(max_gpus=6))
    ratio = Topology.parse(result["recommended"])
    assert ratio.num_attention / ratio.num_ffn > 1, result["why"]
    assert "attention computes" in result["why"] and result["per_gpu"][result["recommended"]] > result["per_gpu"]["1A1F"]
    gain = result["per_gpu"][result["recommended"]] / result["per_gpu"]["1A1F"] - 1
    assert result["predicted_gain"] == pytest.approx(gain, abs=1e-3) and result["busy"]["attention"] > 0.5


def test_ffn_bound_group_is_told_to_lower_the_ratio():
    slow_ffn = dict(attention=(1e-3, 1e-6), ffn=(2e-2, 2e-4), host=(1e-4, 0))
    result = plan(Group("4A1F", **slow_ffn).scrapes([32, 64, 128]), Bounds(max_gpus=6))
    ratio = Topology.parse(result["recommended"])
    assert ratio.num_attention / ratio.num_ffn < 4, result["why"]


def test_noisy_metrics_give_the_same_advice_and_a_close_prediction():
    slow_attention = dict(attention=(2e-3, 8e-4), ffn=(1e-3, 1e-5))
    clean = plan(Group("1A1F", **slow_attention).scrapes([16, 32, 64]), Bounds(max_gpus=6))
    noisy = plan(Group("1A1F", noise=0.05, seed=3, **slow_attention).scrapes([16, 32, 64]), Bounds(max_gpus=6))
    assert noisy["recommended"] == clean["recommended"]
    assert noisy["prediction_error"] < 0.15


def test_following_the_advice_does_not_flap():
    slow_attention = dict(attention=(2e-3, 8e-4), ffn=(1e-3, 1e-5))
    bounds = Bounds(max_gpus=6)
    first = plan(Group("1A1F", **slow_attention).scrapes([16, 32, 64]), bounds)
    load_per_gpu = 32 / 2
    size = sum(int(part) for part in first["recommended"].rstrip("F").split("A"))
    moved = plan(Group(first["recommended"], **slow_attention).scrapes([load_per_gpu * size * f for f in (0.5, 1, 2)]), bounds)
    assert moved["recommended"] == first["recommended"]


def test_bounds_are_respected():
    slow_attention = dict(attention=(2e-3, 8e-4), ffn=(1e-3, 1e-5))
    result = plan(Group("1A1F", **slow_attention).scrapes([16, 32, 64]), Bounds(max_attention_per_ffn=2, max_gpus=6))
    assert all(Topology.parse(t).num_attention <= 2 * Topology.parse(t).num_ffn for t in result["per_gpu"])
    assert result["recommended"] in ("2A1F", "4A2F")


def test_one_load_gives_a_prediction_but_no_recommendation():
    result = plan(Group("2A1F").scrapes([32, 32, 32]))
    assert result["prediction_error"] < 0.01
    assert result["recommended"] is None and "same batch" in result["why"]


def test_too_few_scrapes_or_no_profiled_steps_say_so():
    group = Group("2A1F")
    with pytest.raises(TooFewMetrics, match="two scrapes"):
        plan(group.scrapes([]))
    unprofiled = Group("2A1F")
    before = parse_exposition(unprofiled.exposition(), 0.0)
    unprofiled.run(32, profile_every=10**9)
    with pytest.raises(TooFewMetrics, match="profiled steps"):
        plan([before, parse_exposition(unprofiled.exposition(), unprofiled.clock)])


def test_afd_plan_command_refuses_bad_input_with_one_line():
    run = lambda *a: subprocess.run([sys.executable, "-m", "afd", "plan", *a], capture_output=True, text=True)  # noqa: E731
    missing = run("--state-file", "/nonexistent/state.json", "--samples", "2", "--interval", "0.01")
    assert missing.returncode == 1 and missing.stderr.startswith("error: cannot plan: --state-file /nonexistent")
    few = run("--scrape", "http://127.0.0.1:1/metrics", "--samples", "1")
    assert few.returncode == 1 and "--samples 1" in few.stderr
    both = run("--scrape", "x", "--state-file", "y")
    assert both.returncode == 2 and "not allowed with" in both.stderr


def _recorded(fake: FakePrometheus, now: float, **labels) -> None:
    """Four snapshots of a simulated 2A1F group, 10 s apart, ending at `now`."""
    group = Group("2A1F")
    for index, load in enumerate([8, 16, 32, 64]):
        group.run(load)
        fake.record(now - 10 * (3 - index), group.exposition(), **labels)


def test_plan_reads_one_group_from_prometheus():
    fake, now = FakePrometheus(), 1_800_000_000.0
    _recorded(fake, now, afd_io_name="demo", afd_io_group="0", namespace="ns")
    other = Group("4A1F")
    other.run(32)
    fake.record(now, other.exposition(), afd_io_name="demo", afd_io_group="1", namespace="ns")
    server = fake.serve()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        scrapes = scrape_history(url, selector("demo", 0, "ns"), 4, 10.0, now)
        result = plan(scrapes)
        assert result["current"] == "2A1F" and result["windows"] == 3 and result["fit_step_error_median"] < 0.01
        assert result["model"]["ffn"]["slope_s_per_token"] == pytest.approx(2e-5, rel=1e-3)  # group 1 kept out
        with pytest.raises(PrometheusError, match="query refused|HTTP 400"):
            scrape_at(url + "/nothing", selector("demo", 0), now)
    finally:
        server.shutdown()
    with pytest.raises(PrometheusError, match="127.0.0.1:1"):
        scrape_at("http://127.0.0.1:1", selector("demo", 0), now)


def test_afd_plan_prometheus_needs_a_deployment():
    run = subprocess.run([sys.executable, "-m", "afd", "plan", "--prometheus", "http://127.0.0.1:1"],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "--prometheus needs --deployment" in run.stderr


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="no prometheus binary on PATH (Debian: apt-get install -y prometheus)")
def test_afd_plan_against_a_real_prometheus(tmp_path):
    """A real Prometheus scrapes a tiny exporter of a simulated group every second; `afd plan
    --prometheus` plans from what it stored."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    group, loads = Group("2A1F"), [16, 32, 64, 48]

    class Exporter(BaseHTTPRequestHandler):
        served = 0

        def do_GET(self):  # noqa: N802
            group.run(loads[Exporter.served % len(loads)])  # the load changes at every scrape
            Exporter.served += 1
            body = group.exposition().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    exporter = HTTPServer(("127.0.0.1", 0), Exporter)
    threading.Thread(target=exporter.serve_forever, daemon=True).start()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: afd\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{exporter.server_port}']\n"
        "        labels: {afd_io_name: demo, afd_io_group: '0', namespace: ns}\n")
    server = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        query = urllib.parse.urlencode({"query": 'afd_step_tokens_count{role="attention",rank="0"}'})
        deadline, stored = time.monotonic() + 60, 0.0
        while stored < 900 and time.monotonic() < deadline:  # nine scrapes of 100 steps
            time.sleep(1)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?{query}", timeout=2) as reply:
                    stored = max([float(r["value"][1]) for r in json.loads(reply.read())["data"]["result"]] + [0.0])
            except OSError:
                continue
        run = subprocess.run([sys.executable, "-m", "afd", "plan", "--prometheus", f"http://127.0.0.1:{port}",
                              "--deployment", "demo", "--namespace", "ns", "--samples", "4", "--interval", "2",
                              "--json"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        result = json.loads(run.stdout)
        assert result["current"] == "2A1F" and result["windows"] == 3 and result["predicted_tokens_per_s"] > 0
    finally:
        server.terminate()
        server.wait(timeout=30)
        exporter.shutdown()


def test_each_steady_level_is_checked_against_one_fit_over_all_windows():
    from afd.planner.levels import check_levels

    costs = dict(attention=(2e-3, 1e-4), ffn=(1e-3, 2e-5), host=(4e-3, 2e-5), wire=(5e-4, 1e-6))
    group = Group("1A1F", **costs)
    group.run(8)  # ranks export their series once they have stepped
    scrapes = [parse_exposition(group.exposition(), group.clock)]
    for load in (32, 80, 128):  # steady 32, a transition, steady 128: windows 0, 1, 2
        group.run(load)
        scrapes.append(parse_exposition(group.exposition(), group.clock))
    result = check_levels(scrapes, [0, 2], ["2A1F", "3A1F", "2A2F"], Bounds(max_gpus=4))
    assert result["current"] == "1A1F" and result["windows"] == 3

    def line(term, tokens):
        return costs[term][0] + costs[term][1] * tokens

    def truth(topology, concurrency):  # one stage: the FFN's time adds to the step
        n, m = concurrency / topology.num_attention, concurrency / topology.num_ffn
        return concurrency / (line("host", n) + line("attention", n) + line("ffn", m) + line("wire", n))

    for level, load in zip(result["levels"], (32, 128)):
        assert level["measured_tokens_per_s"] == pytest.approx(truth(Topology(1, 1), load), rel=1e-3)
        assert level["prediction_error"] < 0.01 and level["within_tolerance"] and level["concurrency"] == pytest.approx(load)
        for name, scale in (("2A1F", 1.5), ("3A1F", 2), ("2A2F", 2)):
            got = level["predictions"][name]
            assert got["concurrency"] == pytest.approx(load * scale)
            assert got["tokens_per_s"] == pytest.approx(truth(Topology.parse(name), load * scale), rel=1e-3)
            assert got["per_gpu"] == pytest.approx(got["tokens_per_s"] / (2 * scale), rel=1e-3)
        assert level["recommended"] in ("1A1F", "2A1F", "3A1F", "2A2F") and level["why"]


def test_steady_levels_need_two_loads_and_traffic_in_every_checked_window():
    from afd.planner.levels import check_levels

    with pytest.raises(TooFewMetrics, match="same batch"):
        check_levels(Group("1A1F").scrapes([32, 32, 32]), [1, 2], ["2A1F"])
    idle = Group("1A1F").scrapes([8, 32, 128])  # window 0 starts before the ranks' first step: empty
    idle.append(idle[-1])  # window 3: no step
    assert len(check_levels(idle, [1, 2], ["2A1F"])["levels"]) == 2
    with pytest.raises(TooFewMetrics, match="window 3"):
        check_levels(idle, [1, 3], ["2A1F"])


def test_a_window_steps_every_wall_second_per_step_when_the_loop_overlaps_steps():
    from afd.planner.samples import RankSample, window

    def sample(at, steps, duration_sum):
        return RankSample("attention", 0, at, {"afd_step_duration_seconds_sum": duration_sum,
                                               "afd_step_duration_seconds_count": steps,
                                               "afd_layer_compute_seconds_sum|0|": 0.001 * steps,
                                               "afd_layer_compute_seconds_count|0|": steps})

    start = sample(0.0, 0, 0.0)
    assert window(start, sample(10.0, 1000, 19.0)).step_s == pytest.approx(0.010)  # pipelined: durations overlap
    assert window(start, sample(30.0, 1000, 10.0)).step_s == pytest.approx(0.010)  # idle time between steps
    assert window(start, sample(2.0, 1000, 20.0)).step_s == pytest.approx(0.010)  # instants off: at most half


def test_eager_profiled_steps_are_calibrated_to_the_ordinary_steps():
    """On a GPU the profiled steps run eagerly (no CUDA graphs) and time their layers several times
    slower than the replayed steps around them: the fit keeps their split, at the measured step's level."""
    costs = dict(attention=(2e-3, 1e-4), ffn=(4e-3, 5e-5), host=(0.0, 0.0), wire=(5e-4, 1e-6))
    result = plan(Group("1A1F", eager=(3.0, 0.0), **costs).scrapes([16, 32, 64]), Bounds(max_gpus=4))
    model = result["model"]
    for term in ("attention", "ffn"):
        assert model[term]["intercept_s"] == pytest.approx(costs[term][0], rel=1e-3), term
        assert model[term]["slope_s_per_token"] == pytest.approx(costs[term][1], rel=1e-3), term
    assert result["prediction_error"] < 0.01
    n = 64 * 1.5 / 2  # 2A1F at the same load per GPU: 96 sequences, 48 per attention rank
    step = sum(costs[t][0] + costs[t][1] * (96 if t == "ffn" else n) for t in costs)
    assert result["per_gpu"]["2A1F"] == pytest.approx(96 / step / 3, rel=1e-3)


def test_launch_overhead_of_profiled_steps_still_predicts_the_current_topology():
    """A fixed host-launch cost per layer (eager) inflates small batches most; per window the level
    follows the measured steps, so the current topology's tokens/s stays close at every load."""
    from afd.planner.levels import check_levels

    group = Group("1A1F", stages=2, eager=(1.0, 1e-3), ffn=(3e-3, 4e-5), host=(0.0, 0.0))
    group.run(8)
    scrapes = [parse_exposition(group.exposition(), group.clock)]
    for load in (32, 64, 64, 128, 128):  # steady 32, ramp, steady 64, ramp, steady 128
        group.run(load)
        scrapes.append(parse_exposition(group.exposition(), group.clock))
    levels = check_levels(scrapes, [0, 2, 4], ["2A1F"], Bounds(max_gpus=4), held_out=True)["levels"]
    assert [level["within_tolerance"] for level in levels] == [True, True, True], levels
    middle = levels[1]["held_out"]  # 64 predicted from the 32 and 128 windows only
    assert middle["extrapolates"] and middle["prediction_error"] < 0.15, middle


TABLE_FIELDS = ["current", "stages", "concurrency", "measured_tokens_per_s", "predicted_tokens_per_s", "prediction_error",
                "recommended", "recommended_tokens_per_s", "predicted_gain", "why", "per_gpu"]


def test_the_table_prints_an_idle_last_window():
    """The last window idle (as `afd plan --prometheus` finds a quiet group): null error and no advice."""
    from afd.planner.command import render_table

    result = plan(Group("2A1F").scrapes([16, 32, 64, 0]))
    assert result["prediction_error"] is None and result["recommended"] is None
    table = render_table(result)
    assert "model error -" in table and "recommended  -" in table and result["why"] in table


# what the table shows for each field set to null: a dash where it stood, or the optional part left out
NULL_SHOWN = {
    "current": "current      - (stages 1)", "stages": "(stages -)", "concurrency": ", - decoding sequences",
    "measured_tokens_per_s": "measured     - tokens/s", "predicted_tokens_per_s": "predicted    - tokens/s",
    "prediction_error": "(model error -)", "recommended": "recommended  - (", "recommended_tokens_per_s": "recommended  5A1F, +",
    "predicted_gain": "tokens/s)\nwhy", "why": "why          -\n", "per_gpu": "why",
}


@pytest.mark.parametrize("field", TABLE_FIELDS)
def test_the_table_prints_a_dash_for_any_null_field(field):
    from afd.planner.command import render_table

    result = plan(Group("1A1F", attention=(2e-3, 8e-4), ffn=(1e-3, 1e-5)).scrapes([16, 32, 64]), Bounds(max_gpus=6))
    assert result["recommended"] == "5A1F" and all(result.get(name) is not None for name in TABLE_FIELDS)
    nulled = render_table({**result, field: None})
    assert NULL_SHOWN[field] in nulled and nulled != render_table(result)
    assert ("per GPU at the same load per GPU:" in nulled) == (field != "per_gpu")


def test_the_table_prints_a_null_rate_per_gpu():
    from afd.planner.command import render_table

    table = render_table({"current": "2A1F", "per_gpu": {"2A1F": 10.0, "4A1F": None}})
    assert table.splitlines()[-1].split() == ["4A1F", "-"] and "2A1F        10.0" in table


def test_the_plan_reports_the_prefix_hit_rate_of_the_last_window():
    """Prompt tokens found in the prefix cache are not computed: the plan says what share they were (issue 51)."""
    from afd.planner.command import render_table

    scrapes = Group("2A1F").scrapes([16, 32, 64])
    assert plan(scrapes)["prefix_hit_rate"] is None  # no prefix-cache series: nothing said
    for index, scrape in enumerate(scrapes):
        for sample in scrape:
            if sample.role == "attention":
                sample.values.update({"afd_prefix_cache_queries_total": 1000.0 * index,
                                      "afd_prefix_cache_hits_total": 300.0 * index + (index == len(scrapes) - 1) * 450})
    result = plan(scrapes)
    assert result["prefix_hit_rate"] == pytest.approx(0.75)  # the last window's: (300 + 450) of 1000
    assert "prefix cache 75.0% of prompt tokens found cached" in render_table(result)
