"""The KV cache on a GPU is sized from the profiled peak of the largest step (fake device memory on CPU)."""

import pytest
import torch

import afd.runners.profile_step as profile_step
from afd.config import AFDConfig
from afd.kv.budget import GRAPH_MARGIN_BYTES, graph_margin_bytes, kv_budget_from, plan_kv_budget, profile_peak
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.profile_step import plan_profile_shapes
from afd.roles.kv_sizing import profiled_cache_tokens

GIB = 1 << 30


class FakeMemory:
    """80 GiB device, 20 GiB in use, 1 GiB allocated by torch; a run peaks `peak_gib` above that."""

    def __init__(self, log: list, peak_gib: float = 2.0):
        self.log, self.peak_bytes = log, int(GIB + peak_gib * GIB)

    def free_and_total(self):
        return 60 * GIB, 80 * GIB

    def allocated(self):
        return GIB

    def reserved(self):
        return 3 * GIB

    def reset_peak(self):
        self.log.append("reset")

    def peak(self):
        self.log.append("peak")
        return self.peak_bytes

    def release_cached(self):
        self.log.append("release")


def test_the_budget_is_the_utilization_less_what_is_in_use_the_profiled_peak_and_the_graph_margin():
    budget = plan_kv_budget(FakeMemory([]), 0.9, 2 * GIB, bytes_per_token=1024)
    assert budget.tokens == (int(0.9 * 80 * GIB) - 20 * GIB - 2 * GIB - GRAPH_MARGIN_BYTES) // 1024
    assert (budget.in_use_bytes, budget.activation_bytes) == (20 * GIB, 2 * GIB)
    with pytest.raises(RuntimeError, match="the largest step peaked at 60.0 GiB.*lower max_num_batched_tokens"):
        plan_kv_budget(FakeMemory([]), 0.9, 60 * GIB, bytes_per_token=1024)


def test_the_account_splits_what_is_in_use_into_tensors_allocator_fragments_and_the_rest():
    budget = kv_budget_from(total=80 * GIB, free=50 * GIB, allocated=20 * GIB, reserved=28 * GIB, utilization=0.9,
                            activation_bytes=2 * GIB, bytes_per_token=GIB // 1024, margin_bytes=GIB)
    assert (budget.allocated_bytes, budget.held_bytes, budget.other_bytes) == (20 * GIB, 8 * GIB, 2 * GIB)
    kv = budget.tokens * (GIB // 1024)
    parts = budget.allocated_bytes + budget.held_bytes + budget.other_bytes + 2 * GIB + GIB + kv
    assert int(0.9 * 80 * GIB) - GIB // 1024 < parts <= int(0.9 * 80 * GIB)
    assert "20.00 weights and buffers + 2.00 outside torch" in budget.describe(GIB // 1024)
    assert "8.00 held unused by the allocator" in budget.describe(GIB // 1024)
    with pytest.raises(ValueError, match="inconsistent device memory"):
        kv_budget_from(80 * GIB, 50 * GIB, 29 * GIB, 28 * GIB, 0.9, 0, 1024, 0)


def test_the_peak_is_read_after_the_run_and_counted_above_what_was_allocated_before():
    log = []
    assert profile_peak(lambda: log.append("run"), FakeMemory(log, peak_gib=3)) == 3 * GIB
    assert log == ["release", "reset", "run", "peak", "release"]


def test_profiled_shapes_fill_the_budget_evenly_and_as_one_chunk_among_one_token_rows():
    assert plan_profile_shapes(10, 4, 100) == [(3, 3, 2, 2), (7, 1, 1, 1)]
    assert plan_profile_shapes(10, 4, 6) == [(3, 3, 2, 2), (5, 1, 1, 1)]  # no prompt is longer than the context
    assert plan_profile_shapes(3, 8, 100) == [(1, 1, 1)]  # fewer tokens than seats: one shape
    assert plan_profile_shapes(8192, 1, 100_000) == [(8192,)]


@pytest.mark.parametrize("role, stages", [("attention", 2), ("monolithic", 1)])
def test_sizing_runs_the_largest_steps_of_the_role_between_reset_and_peak(checkpoints, monkeypatch, role, stages):
    """The attention role profiles its own half with zeros for the FFN's answer: no FFN rank is needed."""
    path = str(checkpoints["deepseek_v2"])
    config = AFDConfig(role=role, model=path, device="cpu", stages=stages, max_num_batched_tokens=40, max_num_seqs=6)
    loaded = load_model(path, role)
    log, real_sample = [], profile_step.sample

    def sampled(logits, params, generators):
        log.append(("sample", tuple(logits.shape)))
        return real_sample(logits, params, generators)

    monkeypatch.setattr(profile_step, "sample", sampled)
    tokens = profiled_cache_tokens(config, loaded, FakeMemory(log), torch.float32, torch.device("cpu"))
    vocab = loaded.spec.vocab_size
    assert log == ["release", "reset", ("sample", (6, vocab)), ("sample", (6, vocab)), "peak", "release"]
    per_token = KVCache.bytes_per_token(loaded.model.kv_layouts(), torch.float32)
    assert tokens == (int(0.9 * 80 * GIB) - 20 * GIB - 2 * GIB - GRAPH_MARGIN_BYTES) // per_token


def test_piecewise_prompt_graphs_keep_their_pool_out_of_the_cache(checkpoints):
    """With graphs on, the margin grows with the largest prompt-step bucket (capped by max_num_batched_tokens)."""
    assert graph_margin_bytes(0) == GRAPH_MARGIN_BYTES and graph_margin_bytes(2048) == GRAPH_MARGIN_BYTES + GIB
    path = str(checkpoints["deepseek_v2"])
    loaded = load_model(path, "monolithic")
    tokens = {}
    for graphs in (False, True):
        config = AFDConfig(role="monolithic", model=path, device="cpu", max_num_batched_tokens=40, max_num_seqs=6,
                           cuda_graphs=graphs, mixed_graph_tokens=2048)
        tokens[graphs] = profiled_cache_tokens(config, loaded, FakeMemory([]), torch.float32, torch.device("cpu"))
    per_token = KVCache.bytes_per_token(loaded.model.kv_layouts(), torch.float32)
    expected_drop = 40 * (512 << 10) // per_token  # 40 tokens of buckets: min(2048, max_num_batched_tokens)
    graph_tables = 4 * 6 // 16 + 1  # graphs on: block-table bytes per token (afd.roles.kv_sizing)
    assert tokens[True] == (int(0.9 * 80 * GIB) - 20 * GIB - 2 * GIB - GRAPH_MARGIN_BYTES - 40 * (512 << 10)) // (
        per_token + graph_tables)
    assert tokens[False] - tokens[True] >= expected_drop
