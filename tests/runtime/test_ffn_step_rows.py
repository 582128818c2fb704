"""The FFN's afd_step_tokens counts a step's rows whether its body runs or a CUDA graph replays it."""

from __future__ import annotations

from afd.config import AFDConfig
from afd.connector import wire
from afd.metrics.layer_clock import StepInstruments
from afd.roles.ffn import build_ffn


class ReplayOnly:
    """Stands in for afd.graphs.ffn_graphs.FFNGraphs holding a graph for every step: the body never runs."""

    def run(self, plans, body):
        return "replay"


def test_a_replayed_step_counts_its_rows_once_per_crossing_layer(checkpoints):
    config = AFDConfig(num_attention_ranks=2, num_ffn_ranks=1, connector="loopback", model=str(checkpoints["qwen3_moe"]),
                       ffn_address_template="replay-rows-test", role="ffn")
    runner = build_ffn(config)
    try:
        executor, seen = runner.executor, []
        executor.graphs = ReplayOnly()
        executor.instruments = StepInstruments(on_step=lambda seconds, rows: seen.append(rows))
        executor.plane.finish_step = lambda peers, watch: {}
        executor.run_step({b"a0": wire.StepPlan(1, (3, 2), replay=True), b"a1": wire.StepPlan(1, (4, 0), replay=True)},
                          watch=None)
        assert seen == [9 * len(executor.crossing)] and len(executor.crossing) > 0
    finally:
        runner.link.close()
