"""Expert parallelism in the FFN role: shard placement, what each shard loads, and that the shards sum to the whole."""

import re

import pytest
import torch

from afd.models.expert_shard import routed_expert_bytes
from afd.models.loader import load_model
from afd.config.topology import TopologyError, shard_range


def test_shard_ranges_cover_every_item_once():
    for count in (1, 7, 8, 64, 160):
        for shards in range(1, min(count, 9) + 1):
            ranges = [shard_range(count, shards, s) for s in range(shards)]
            assert ranges[0][0] == 0 and ranges[-1][1] == count
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1
    assert shard_range(10, 4, 1) == (3, 6)
    with pytest.raises(TopologyError):
        shard_range(8, 2, 2)


def _experts_read(keys):
    return {int(m[1]) for k in keys if (m := re.search(r"\.experts\.(\d+)\.", k))}


@pytest.mark.parametrize("name", ["deepseek_v2", "qwen3_moe", "deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("shards", [2, 3, 4])
def test_shards_hold_their_experts_and_sum_to_the_whole(name, shards, checkpoints):
    """Each shard reads only its experts, holds ≈1/G of the routed expert bytes, and the G partial
    FFN outputs add up to the unsharded FFN (gate on either side; dense layers included)."""
    path = str(checkpoints[name])
    for gate_on_attention in (False, True):
        whole = load_model(path, "ffn", gate_on_attention)
        parts = [load_model(path, "ffn", gate_on_attention, shard=(s, shards)) for s in range(shards)]
        total = routed_expert_bytes(whole.model)
        sizes = [routed_expert_bytes(p.model) for p in parts]
        print(f"{name} G={shards}: routed expert bytes {total} whole, per shard {sizes} "
              f"({[round(b / total, 3) for b in sizes]} of the whole)")
        assert sum(sizes) == total
        assert max(sizes) <= total / shards * 1.5 and max(sizes) < total
        num_experts = whole.spec.num_experts
        for s, part in enumerate(parts):
            start, stop = shard_range(num_experts, shards, s)
            assert _experts_read(part.loaded_keys) == set(range(start, stop))
        torch.manual_seed(0)
        hidden = torch.randn(7, whole.spec.hidden_size)
        for index in whole.crossing:
            layer = whole.model.layers[index]
            if gate_on_attention:
                logits = torch.randn(7, num_experts)
                expected = layer.expert_half(hidden, logits)
                got = sum(p.model.layers[index].expert_half(hidden, logits) for p in parts)
            else:
                expected = layer.ffn_half(hidden)
                got = sum(p.model.layers[index].ffn_half(hidden) for p in parts)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_more_shards_than_experts_is_refused(checkpoints):
    from afd.models.expert_shard import ShardError

    with pytest.raises(ShardError, match="exceeds the model's 8 routed experts"):
        load_model(str(checkpoints["qwen3_moe"]), "ffn", shard=(0, 9))


# -- the whole group: greedy tokens equal transformers -------------------------------------------
# Each case covers a different corner; together: both families, 1A1F/2A1F/3A2F, G = 2 and 4 (and 3,
# which does not divide the 8 experts), stages 1 and 2, the gate on either side, loopback and zmq.
GROUP_CASES = [
    ("qwen3_moe", "1A1F", 2, 1, "ffn", "loopback"),
    ("deepseek_v2", "2A1F", 4, 2, "attention", "loopback"),
    ("qwen3_moe", "3A2F", 2, 2, "attention", "loopback"),
    ("deepseek_v2", "3A2F", 3, 1, "ffn", "loopback"),
    ("qwen3_moe", "3A2F", 4, 2, "ffn", "loopback"),
    ("deepseek_v2", "1A1F", 2, 2, "ffn", "zmq"),
    ("qwen3_moe", "2A1F", 4, 1, "attention", "zmq"),
    ("deepseek_v2", "3A2F", 2, 1, "attention", "zmq"),
    # DeepSeek-V3 (noaux_tc, the router bias on the shards) and its FP8 checkpoint (vs transformers, dequantized)
    ("deepseek_v3", "3A2F", 2, 2, "attention", "loopback"),
    ("deepseek_v3_fp8", "2A1F", 2, 1, "ffn", "loopback"),
    ("deepseek_v3", "1A1F", 2, 2, "ffn", "zmq"),
    ("deepseek_v3_fp8", "3A2F", 2, 1, "attention", "zmq"),
    # GLM-4.x (V3's MoE behind partial-rotary GQA with q/k norms and biases) and its FP8 checkpoint
    ("glm4_moe", "2A1F", 2, 2, "attention", "zmq"),
    ("glm4_moe_fp8", "3A2F", 4, 1, "ffn", "loopback"),
]


@pytest.mark.parametrize("name, topology, shards, stages, gate, connector", GROUP_CASES)
def test_expert_parallel_group_equals_transformers(name, topology, shards, stages, gate, connector, checkpoints,
                                                   hf_reference, monkeypatch):
    from afd.config import AFDConfig
    from tests.conftest import NEW_TOKENS, PROMPTS, max_relative_error

    tokens, logits = hf_reference(name)
    config = AFDConfig(
        num_attention_ranks=int(topology[0]), num_ffn_ranks=int(topology[2]), connector=connector, stages=stages,
        gate_on_attention=gate == "attention", model=str(checkpoints[name]), ffn_expert_parallel=shards,
        ffn_address_template=f"ep-{name}-{topology}-{shards}-{stages}-{gate}-{{rank}}",
    )
    if connector == "loopback":
        from afd.local.group_threads import generate_in_threads

        result = generate_in_threads(config, PROMPTS, NEW_TOKENS, ignore_eos=True)
        got_tokens, got_logits = result.tokens, result.last_logits
    else:  # through the CLI: `afd generate --ffn-expert-parallel G`, one process per rank and shard
        import json

        # up to 3 + 2 x 4 processes on a CI machine of 2 shared cores: a slow peer is not a lost one here
        monkeypatch.setenv("AFD_PEER_TIMEOUT_S", "30")

        from tests.runtime.test_generate_cli import afd, prompt_args

        done = afd("generate", "--model", checkpoints[name], "--topology", topology, "--stages", stages, "--gate", gate,
                   "--ffn-expert-parallel", shards, *prompt_args(PROMPTS), "--max-tokens", NEW_TOKENS, "--ignore-eos",
                   "--json", "--with-logits")
        assert done.returncode == 0, done.stderr
        output = json.loads(done.stdout.strip().splitlines()[-1])
        got_tokens, got_logits = output["outputs"], [torch.tensor(row) for row in output["last_logits"]]
    assert got_tokens == tokens
    assert max_relative_error(got_logits, logits) < 1e-4


def test_expert_load_counts_each_shards_experts(checkpoints):
    """Sampled expert load: each shard counts its own experts (global ids in the series); together
    they count every routed (token, expert) pair once."""
    from prometheus_client import CollectorRegistry

    from afd.metrics.expert_load import ExpertLoad, ExpertLoadCollector

    path = str(checkpoints["deepseek_v2"])
    torch.manual_seed(1)
    hidden = torch.randn(11, 64)
    series = {}
    for shard in range(2):
        loaded = load_model(path, "ffn", shard=(shard, 2))
        load = ExpertLoad(loaded.model.layers, loaded.crossing)
        for layer in loaded.crossing:
            load.record(layer, hidden, None)
        load.flush()
        registry = CollectorRegistry()
        ExpertLoadCollector(registry, 0, shard, load)
        for family in registry.collect():
            for sample in family.samples:
                if sample.name == "afd_expert_tokens_total":
                    series[(sample.labels["layer"], sample.labels["expert"])] = (sample.labels["shard"], sample.value)
    top_k = 2
    moe_layers = {layer for layer, _ in series}
    assert moe_layers == {"1", "2"}  # layer 0 is dense
    for layer in moe_layers:
        counts = {int(e): v for (lay, e), (_, v) in series.items() if lay == layer}
        assert sorted(counts) == list(range(8)) and sum(counts.values()) == 11 * top_k
    assert {series[("1", str(e))][0] for e in range(4)} == {"0"} and {series[("1", str(e))][0] for e in range(4, 8)} == {"1"}


def test_afd_up_plans_one_process_per_shard(tmp_path):
    from afd.config import AFDConfig
    from afd.local.up import plan_ranks

    base = AFDConfig(num_attention_ranks=2, model=str(tmp_path), ffn_expert_parallel=2, port_stride=2)
    ranks = plan_ranks(base)
    assert [r.name for r in ranks] == ["ffn-0-shard-0", "ffn-0-shard-1", "attention-0", "attention-1"]
    ffn_ports = [r.config.link.ffn_ports(r.config.group.own_endpoint) for r in ranks if r.role == "ffn"]
    metrics = [r.config.process.metrics_port for r in ranks]
    assert len(set(ffn_ports)) == 2 and len(set(metrics)) == 4
    assert ranks[1].describe(123)["shard"] == 1


def test_config_checks_the_shard():
    from afd.config import AFDConfig, ConfigError, values_from_env

    with pytest.raises(ConfigError, match="ffn_shard=2: must be in 0..1"):
        AFDConfig(role="ffn", ffn_expert_parallel=2, ffn_shard=2, port_stride=2)
    with pytest.raises(ConfigError, match="ffn_expert_parallel=0"):
        AFDConfig(ffn_expert_parallel=0)
    env = {"AFD_ROLE": "ffn", "AFD_FFN_EXPERT_PARALLEL": "4", "HOSTNAME": "demo-g0-ffn-6"}
    assert values_from_env(env) | {} == {"role": "ffn", "ffn_expert_parallel": 4, "rank": 1, "ffn_shard": 2}
    assert values_from_env({**env, "AFD_ROLE": "attention", "HOSTNAME": "demo-g0-attn-6"})["rank"] == 6


@pytest.fixture(scope="module")
def qwen_top6(tmp_path_factory):
    """Qwen3-MoE routing each token to 6 of its 8 experts: a shard then sums several of a token's pairs."""
    from afd.checkpoint_tools.tiny import make_tiny_model

    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("top6") / "qwen", seed=0,
                           overrides={"num_experts_per_tok": 6})


@pytest.mark.parametrize("shards, gate", [(2, "ffn"), (4, "attention")])
def test_bf16_shards_equal_the_unsharded_rank(shards, gate, qwen_top6):
    """Shards return float32 partial sums and attention rounds once, as the unsharded rank rounds its
    float32 sum of a token's pairs once: bf16 logits and greedy tokens are the unsharded rank's
    (measured: partials rounded to bf16 change 8 of 20 sequences here). Stepped with `greedy_generate`,
    whose batches do not depend on timing (in bf16 a different batch alone can change a token)."""
    import threading

    from afd.config import AFDConfig
    from afd.engine.generation import greedy_generate
    from afd.roles.attention import build_attention
    from afd.roles.ffn import build_ffn
    from tests.conftest import PROMPTS

    def generate(g):
        config = AFDConfig(connector="loopback", model=str(qwen_top6), dtype="bfloat16", device="cpu",
                           ffn_expert_parallel=g, gate_on_attention=gate == "attention",
                           ffn_address_template=f"bf16-{g}-{gate}-{{rank}}")
        stop = threading.Event()
        workers = [build_ffn(config.replace(role="ffn", ffn_shard=s)) for s in range(g)]
        threads = [threading.Thread(target=w.serve, args=(stop,), daemon=True) for w in workers]
        for thread in threads:
            thread.start()
        role = build_attention(config, 4096)
        try:
            return greedy_generate(role.runner, role.kv_cache, PROMPTS * 4, 48, ignore_eos=True)
        finally:
            role.close()
            stop.set()
            for thread in threads:
                thread.join(5)

    sharded, whole = generate(shards), generate(1)
    assert sharded.tokens == whole.tokens
    assert all(torch.equal(a, b) for a, b in zip(sharded.last_logits, whole.last_logits))


def test_the_shards_of_a_rank_export_distinct_series():
    """Two shards' expositions merge (afd up's front door) without a duplicate series."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from afd.metrics.expert_load import shard_labelled
    from afd.server.front.metrics import merge_expositions

    texts = []
    for shard in range(2):
        registry = CollectorRegistry()
        Counter("afd_ffn_steps", "FFN steps run", ["role", "rank"], registry=registry).labels("ffn", "0").inc(shard + 1)
        texts.append(generate_latest(shard_labelled(registry, shard)).decode())
    merged = merge_expositions(texts).decode()
    samples = [(s.name, tuple(sorted(s.labels.items())), s.value) for f in text_string_to_metric_families(merged)
               for s in f.samples if s.name == "afd_ffn_steps_total"]
    assert sorted(samples) == [("afd_ffn_steps_total", (("rank", "0"), ("role", "ffn"), ("shard", "0")), 1.0),
                               ("afd_ffn_steps_total", (("rank", "0"), ("role", "ffn"), ("shard", "1")), 2.0)]


@pytest.mark.parametrize("gate", ["ffn", "attention"])
def test_attention_transfer_bytes_count_every_shard(gate, checkpoints):
    """afd_transfer_bytes on the attention rank counts what its G shards count: each shard receives
    every row, and each sends back a float32 partial sum."""
    import threading

    from afd.config import AFDConfig
    from afd.engine.offline import generate_with_engine
    from afd.roles.attention import build_attention
    from afd.roles.ffn import build_ffn
    from tests.conftest import NEW_TOKENS, PROMPTS

    base = AFDConfig(connector="loopback", model=str(checkpoints["deepseek_v2"]), ffn_expert_parallel=2,
                     gate_on_attention=gate == "attention", ffn_address_template=f"ep-bytes-{gate}-{{rank}}")
    stop = threading.Event()
    shards = [build_ffn(base.replace(role="ffn", rank=0, ffn_shard=s)) for s in range(2)]
    threads = [threading.Thread(target=w.serve, args=(stop,), daemon=True) for w in shards]
    for thread in threads:
        thread.start()
    role = build_attention(base.replace(role="attention", rank=0), 4096)
    try:
        generate_with_engine(role.runner, role.kv_cache, PROMPTS, NEW_TOKENS, role.loaded.spec.eos_token_ids, True,
                             role.device, link=role.link)
        sent = dict(role.runner.transfer_bytes)
    finally:
        role.close("test finished")
        stop.set()
        for thread in threads:
            thread.join(timeout=5)
    received = [w.executor.transfer_bytes for w in shards]
    assert sent["send"] > 0 and received[0]["recv"] == received[1]["recv"]
    assert sent["send"] == sum(r["recv"] for r in received)
    assert sent["recv"] == sum(r["send"] for r in received)
