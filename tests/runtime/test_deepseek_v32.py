"""DeepSeek-V3.2 (sparse attention through the lightning indexer) equals transformers' DeepseekV32ForCausalLM.

The tiny checkpoints select 16 keys a query (`index_topk`) with 8 index heads, and the prompts run to 150 tokens,
so nearly every query attends sparsely; the short prompt crosses `index_topk` while it decodes. Beside them:
a query LoRA, noaux_tc expert groups, a dense first layer, YaRN and an MTP layer in the files (V3's toy).
Most cases run in-process (the monolith, the loopback split); two go through `afd generate` over zmq.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from afd.config import AFDConfig
from afd.engine.generation import greedy_generate
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic_runner import MonolithicRunner
from tests.conftest import max_relative_error

_gen = torch.Generator().manual_seed(32)
PROMPTS = [torch.randint(3, 380, (length,), generator=_gen).tolist() for length in (40, 150, 9, 75)]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    """name → folder: fp32, FP8 (the published block format; the indexer's wq_b/wk FP8, weights_proj not) and the
    FP8 one's dequantized copy (what transformers runs on CPU)."""
    from afd.checkpoint_tools.fp8_convert import dequantize_folder
    from afd.checkpoint_tools.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("v32")
    folders = {"fp32": make_tiny_model("deepseek_v32", root / "fp32", seed=0),
               "fp8": make_tiny_model("deepseek_v32", root / "fp8", seed=3, fp8=True)}
    folders["fp8_dequantized"] = dequantize_folder(folders["fp8"], root / "fp8_dequantized")
    return folders


@pytest.fixture(scope="module")
def reference(v32):
    """name → (tokens, last-step logits) of transformers' greedy generate, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def run(name):
        if name not in cache:
            model = AutoModelForCausalLM.from_pretrained(v32.get(f"{name}_dequantized", v32[name]),
                                                         dtype=torch.float32, attn_implementation="eager")
            model.generation_config.eos_token_id = None
            tokens, logits = [], []
            for prompt in PROMPTS:
                out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True, pad_token_id=0)
                tokens.append(out.sequences[0, len(prompt):].tolist())
                logits.append(out.logits[-1][0].float())
            cache[name] = tokens, logits
        return cache[name]

    return run


def monolith(path, keep_fp8=None, index_topk=None):
    loaded = load_model(str(path), keep_fp8=keep_fp8)
    if index_topk is not None:
        for layer in loaded.model.layers:
            layer.self_attn.index_topk = index_topk
    cache = KVCache(loaded.model.kv_layouts(), 24 * len(PROMPTS), torch.float32, "cpu", block_size=8)
    return greedy_generate(MonolithicRunner(loaded, cache), cache, PROMPTS, NEW_TOKENS, ignore_eos=True)


def test_monolith_equals_transformers_and_the_selection_decides(v32, reference):
    tokens, logits = reference("fp32")
    result = monolith(v32["fp32"])
    assert result.tokens == tokens
    assert max_relative_error(result.last_logits, logits) < 1e-4
    dense = monolith(v32["fp32"], index_topk=10**6)  # every key: what V3 would compute
    assert sum(a != b for a, b in zip(dense.tokens, tokens)) >= 3


@pytest.mark.parametrize("keep_fp8", [False, True])
def test_fp8_monolith_equals_transformers_on_the_dequantized_weights(keep_fp8, v32, reference):
    tokens, logits = reference("fp8")
    loaded = load_model(str(v32["fp8"]), keep_fp8=keep_fp8)
    indexer = loaded.model.layers[0].self_attn.indexer
    assert (type(indexer.wq_b).__name__ == "Fp8Linear") == keep_fp8 and type(indexer.weights_proj).__name__ == "Linear"
    result = monolith(v32["fp8"], keep_fp8=keep_fp8)
    assert result.tokens == tokens
    assert max_relative_error(result.last_logits, logits) < 1e-4


def test_index_keys_are_cached_beside_the_latent_rows_and_counted(v32):
    loaded = load_model(str(v32["fp32"]))
    layouts = loaded.model.kv_layouts()
    assert [(lay.key_dim, lay.index_dim) for lay in layouts] == [(32 + 8, 32)] * 3
    cache = KVCache(layouts, 4, torch.float32, "cpu", block_size=8)
    keys, values, index_keys = cache.layer(1)
    assert index_keys.shape == (keys.shape[0], 32)
    assert KVCache.bytes_per_token(layouts, torch.float32) == 3 * (40 + 32) * 4
    assert cache.nbytes == 5 * 8 * 3 * (40 + 32) * 4  # 4 blocks and the scratch block


def test_a_prompt_fed_in_chunks_equals_transformers(v32, reference, monkeypatch):
    """The engine feeds the 150-token prompt 32 tokens a step: each chunk's queries choose among every key before them."""
    from afd.engine.engine import Engine
    from afd.engine.request import SamplingParams
    from afd.engine.text.tokenizer import load_tokenizer
    from tests.server.conftest import submit_all

    from afd.models.paged_attention import AttentionBatch

    steps, build = [], AttentionBatch.build
    monkeypatch.setattr(AttentionBatch, "build", lambda tables, context, new, *args: steps.append(
        list(zip(context, new))) or build(tables, context, new, *args))
    tokens, _ = reference("fp32")
    loaded = load_model(str(v32["fp32"]))
    cache = KVCache.for_tokens(loaded.model.kv_layouts(), 1024, torch.float32, "cpu")
    engine = Engine(MonolithicRunner(loaded, cache), cache, load_tokenizer(str(v32["fp32"])), (), max_num_seqs=4,
                    max_model_len=256, max_num_batched_tokens=32, device="cpu")
    engine.start()
    try:
        requests = [(p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)) for p in PROMPTS]
        outputs = submit_all(engine, requests).wait(120)
    finally:
        engine.stop()
    assert [[t for out in outs for t in out.token_ids] for outs in outputs] == tokens
    assert any(context > 16 and new > 1 for step in steps for context, new in step)  # a chunk after a sparse one


# the loopback split: 1A1F, 2A1F, 3A2F, stages 1 and 2, the gate on either side (not the whole product: each case
# costs seconds on two shared cores), and the FP8 checkpoint
SPLIT_CASES = [("fp32", "1A1F", 1, "ffn"), ("fp32", "1A1F", 2, "attention"), ("fp32", "2A1F", 2, "ffn"),
               ("fp32", "2A1F", 1, "attention"), ("fp32", "3A2F", 1, "ffn"), ("fp32", "3A2F", 2, "attention"),
               ("fp8", "3A2F", 2, "ffn")]


@pytest.mark.parametrize("name, topology, stages, gate", SPLIT_CASES)
def test_loopback_split_equals_transformers(name, topology, stages, gate, v32, reference):
    from afd.local.group_threads import generate_in_threads

    tokens, logits = reference(name)
    config = AFDConfig(num_attention_ranks=int(topology[0]), num_ffn_ranks=int(topology[2]), connector="loopback",
                       stages=stages, gate_on_attention=gate == "attention", model=str(v32[name]),
                       ffn_address_template=f"v32-{name}-{topology}-{stages}-{gate}-{{rank}}")
    result = generate_in_threads(config, PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert result.tokens == tokens
    assert max_relative_error(result.last_logits, logits) < 1e-4


# expert parallelism 2 in threads; over zmq (one process per rank and shard, through `afd generate`) with and
# without it
GROUP_CASES = [("fp32", "3A2F", 2, 2, "attention", "loopback"), ("fp8", "2A1F", 2, 1, "ffn", "loopback"),
               ("fp32", "2A1F", 1, 2, "attention", "zmq"), ("fp8", "1A1F", 2, 1, "ffn", "zmq")]


@pytest.mark.parametrize("name, topology, shards, stages, gate, connector", GROUP_CASES)
def test_group_equals_transformers(name, topology, shards, stages, gate, connector, v32, reference, monkeypatch):
    tokens, logits = reference(name)
    if connector == "loopback":
        from afd.local.group_threads import generate_in_threads

        config = AFDConfig(num_attention_ranks=int(topology[0]), num_ffn_ranks=int(topology[2]), connector=connector,
                           stages=stages, gate_on_attention=gate == "attention", model=str(v32[name]),
                           ffn_expert_parallel=shards,
                           ffn_address_template=f"v32ep-{name}-{topology}-{shards}-{stages}-{gate}-{{rank}}")
        result = generate_in_threads(config, PROMPTS, NEW_TOKENS, ignore_eos=True)
        got_tokens, got_logits = result.tokens, result.last_logits
    else:
        from tests.runtime.test_generate_cli import afd, prompt_args

        monkeypatch.setenv("AFD_PEER_TIMEOUT_S", "30")  # several processes on two shared cores
        done = afd("generate", "--model", v32[name], "--topology", topology, "--stages", stages, "--gate", gate,
                   "--ffn-expert-parallel", shards, *prompt_args(PROMPTS), "--max-tokens", NEW_TOKENS, "--ignore-eos",
                   "--json", "--with-logits")
        assert done.returncode == 0, done.stderr
        output = json.loads(done.stdout.strip().splitlines()[-1])
        got_tokens, got_logits = output["outputs"], [torch.tensor(row) for row in output["last_logits"]]
    assert got_tokens == tokens
    assert max_relative_error(got_logits, logits) < 1e-4


def test_the_gpu_tests_v32_shaped_checkpoint_loads_with_its_indexer_fp8(tmp_path):
    """tests/gpu/test_gpu_v32_afd.py's checkpoint writer, at small shapes on CPU: the indexer's wq_b/wk FP8 with their
    scales, weights_proj and the LayerNorm not; a prompt of 40 tokens runs through the monolith."""
    from afd.models.fp8 import Fp8Linear
    from tests.gpu.v3_checkpoint import V32_SHAPED, write_v3_shaped

    small = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, n_routed_experts=8,
                 num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128, n_group=4,
                 topk_group=2, num_experts_per_tok=2, index_n_heads=4, index_head_dim=64)
    _, path = write_v3_shaped(None, tmp_path / "fp8", device="cpu", overrides={**V32_SHAPED, **small})
    loaded = load_model(str(path), keep_fp8=True)
    indexer = loaded.model.layers[1].self_attn.indexer
    assert isinstance(indexer.wq_b, Fp8Linear) and isinstance(indexer.wk, Fp8Linear)
    assert type(indexer.weights_proj) is torch.nn.Linear and indexer.k_norm.bias is not None
    cache = KVCache(loaded.model.kv_layouts(), 8, torch.float32, "cpu", block_size=8)
    result = greedy_generate(MonolithicRunner(loaded, cache), cache, [PROMPTS[0]], 4, ignore_eos=True)
    assert len(result.tokens[0]) == 4


def test_plan_fit_counts_what_the_loader_holds(v32):
    """GPU sizing of the tiny FP8 V3.2 (its indexer's wq_b/wk FP8, weights_proj float32) equals the bytes
    load_model(keep_fp8=True) holds, per role and shard; its KV bytes count the index keys."""
    from afd.planner.fit import fit

    path = str(v32["fp8"])
    cr = {"spec": {"attention": {"ranks": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}},
                   "ffn": {"ranks": 1, "expertParallel": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}},
                   "afd": {"dtype": "float32", "computeGateOnAttention": True}}}
    report = fit(json.loads((v32["fp8"] / "config.json").read_text()), cr, gpu_memory_bytes=1 << 30)
    attention, *shards = report.ranks
    held = load_model(path, "attention", True, keep_fp8=True)
    assert attention.weight_bytes + attention.scale_bytes == held.resident_bytes
    assert attention.kv_bytes_per_token == 3 * (32 + 8 + 32) * 4
    for shard, rank in enumerate(shards):
        assert rank.weight_bytes + rank.scale_bytes == load_model(path, "ffn", True, shard=(shard, 2),
                                                                  keep_fp8=True).resident_bytes


def test_a_prompt_whose_first_blocks_are_cached_computes_its_suffix_only_and_equals_transformers(v32, reference):
    """A prefix-cache hit as the engine makes one: sequence B's table starts with the 12 full blocks (96 tokens) that
    sequence A filled with the same prompt; B computes its last 54 tokens only, its queries choosing among index keys
    A wrote. Its greedy tokens are transformers'."""
    from afd.step.layout import SeqLayout

    tokens, _ = reference("fp32")
    prompt, block, hit = PROMPTS[1], 8, 96
    loaded = load_model(str(v32["fp32"]))
    cache = KVCache(loaded.model.kv_layouts(), 64, torch.float32, "cpu", block_size=block)
    runner = MonolithicRunner(loaded, cache)
    first = cache.allocate(hit)
    runner(torch.tensor(prompt[:hit]), SeqLayout((tuple(first),), (0,), (hit,)))
    table = tuple(first + cache.allocate(len(prompt) + NEW_TOKENS - hit))
    pending, context, generated = prompt[hit:], hit, []
    while len(generated) < NEW_TOKENS:
        logits = runner(torch.tensor(pending), SeqLayout((table,), (context,), (len(pending),)))
        context += len(pending)
        pending = [int(logits[0].argmax())]
        generated += pending
    assert generated == tokens[1]
