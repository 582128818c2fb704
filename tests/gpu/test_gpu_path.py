"""GPU path on the device machine: kernels, NCCL AFD parity with the monolith, graphs. Skips without CUDA."""

import json

import pytest
import torch

from tests.conftest import NEW_TOKENS, PROMPTS, max_relative_error
from tests.gpu.afd_ranks import attention_tokens
from tests.gpu.nccl_env import gpu_env, nccl_pairs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_TOKENS = 32


def gathered(table: dict) -> dict:
    """`table` with every gate_up reading pre-gathered rows through TMA (pointers where there is none)."""
    return {tokens: {**cfg, "gate_up": {**cfg["gate_up"], "GATHER": True, "TMA": True}} for tokens, cfg in table.items()}


@pytest.mark.parametrize("kernel", ["triton", "triton-gather", "grouped"])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 2100])
@pytest.mark.parametrize("num_shared", [0, 2])
def test_moe_kernels_equal_the_reference(kernel, tokens, num_shared, monkeypatch):
    from afd.kernels import moe
    from afd.kernels.moe import add_shared
    from afd.models.layers import Experts

    monkeypatch.setenv("AFD_MOE_KERNEL", kernel.removesuffix("-gather"))
    if kernel == "triton-gather":  # the aligned path's gathered gate_up (plain triton: the small path up to 8 tokens)
        monkeypatch.setenv("AFD_MOE_SMALL_TOKENS", "0")
        tuned = moe.device_table
        monkeypatch.setattr(moe, "device_table", lambda *args: gathered(tuned(*args)))
    torch.manual_seed(tokens)
    routed = 16
    experts = Experts(routed + num_shared, 256, 128).cuda()
    experts.gate_up.data.normal_(0, 0.05)
    experts.down.data.normal_(0, 0.05)
    x = torch.randn(tokens, 256, device="cuda")
    ids = torch.stack([torch.randperm(routed, device="cuda")[:4] for _ in range(tokens)])
    weights = torch.rand(tokens, 4, device="cuda")
    all_weights, all_ids = add_shared(weights.double(), ids, routed, num_shared)
    reference = experts.double()(x.double(), all_weights, all_ids)  # float64 per-expert path
    out = moe.experts_cuda(x.bfloat16(), weights.bfloat16(), ids, experts.gate_up.bfloat16(), experts.down.bfloat16(), num_shared)
    assert float((out.double() - reference).norm() / reference.norm()) < 1e-2


def shipped_tables() -> list:
    from afd.kernels.moe import CONFIG_DIR

    return sorted(path for path in CONFIG_DIR.glob("E*_H*_I*_*.json") if "_fp8_" not in path.name)  # FP8: test_gpu_fp8


@pytest.mark.parametrize("path", shipped_tables(), ids=lambda path: path.stem)
def test_every_entry_of_a_shipped_table_equals_the_reference(path, monkeypatch):
    """The tuner only timed its winners: each entry must also compute the MoE, at the table's own shapes and token count."""
    import re

    from afd.kernels import moe
    from afd.kernels.moe import add_shared
    from afd.models.layers import Experts

    num_experts, hidden, inter, device = re.fullmatch(r"E(\d+)_H(\d+)_I(\d+)_(.+)", path.stem).groups()
    if device != torch.cuda.get_device_name().replace(" ", "_"):
        pytest.skip(f"tuned for {device}")
    num_experts, hidden, inter = int(num_experts), int(hidden), int(inter)
    table = {int(tokens): cfg for tokens, cfg in json.loads(path.read_text())["configs"].items()}
    monkeypatch.setenv("AFD_MOE_KERNEL", "triton")
    monkeypatch.setenv("AFD_MOE_SMALL_TOKENS", "0")  # every entry through the aligned path it tunes
    torch.manual_seed(0)
    experts = Experts(num_experts, hidden, inter).cuda()
    experts.gate_up.data.normal_(0, 0.02)
    experts.down.data.normal_(0, 0.02)
    gate_up, down = experts.gate_up.bfloat16(), experts.down.bfloat16()
    num_shared, top_k = 2, 6  # the kernels do not care which model the routing came from
    for tokens, cfg in table.items():
        monkeypatch.setattr(moe, "device_table", lambda *args: {tokens: cfg})
        x = torch.randn(tokens, hidden, device="cuda")
        weights, ids = torch.rand(tokens, num_experts - num_shared, device="cuda").topk(top_k, dim=-1)
        reference = experts(x, *add_shared(weights, ids, num_experts - num_shared, num_shared))
        out = moe.experts_cuda(x.bfloat16(), weights.bfloat16(), ids, gate_up, down, num_shared)
        error = float((out.float() - reference).norm() / reference.norm())
        assert error < 1e-2, f"{path.name}, {tokens} tokens: relative error {error:.2e}"


def test_triton_moe_is_deterministic():
    """The alignment's atomics reorder rows inside an expert's run; the output bits must not change."""
    from afd.kernels.moe import experts_triton

    torch.manual_seed(0)
    gate_up = torch.randn(66, 2 * 128, 256, device="cuda", dtype=torch.bfloat16) * 0.05
    down = torch.randn(66, 256, 128, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    weights, ids = torch.rand(512, 64, device="cuda").topk(6, dim=-1)
    first = experts_triton(x, weights.bfloat16(), ids, gate_up, down, 2)
    for _ in range(5):
        assert torch.equal(experts_triton(x, weights.bfloat16(), ids, gate_up, down, 2), first)


def test_paged_decode_kernel_equals_sdpa():
    from afd.kernels.decode_attention import paged_decode_attention
    from afd.models.paged_attention import AttentionBatch, cached_attention

    torch.manual_seed(0)
    cache_k, cache_v = torch.randn(64, 2, 48, device="cuda"), torch.randn(64, 2, 32, device="cuda")
    tables, context = [[3, 1, 7], [0], [5, 9, 2, 4]], [9, 2, 13]
    batch = AttentionBatch.build(tables, context, [1, 1, 1], 4, "cpu")  # the SDPA path
    q, k, v = torch.randn(3, 4, 48, device="cuda"), torch.randn(3, 2, 48, device="cuda"), torch.randn(3, 2, 32, device="cuda")
    cpu = lambda t: t.cpu()  # noqa: E731
    reference = cached_attention(cpu(q), cpu(k), cpu(v), cpu(cache_k), cpu(cache_v), batch, 0.2)
    cached_attention(q, k, v, cache_k, cache_v, AttentionBatch.build(tables, context, [1, 1, 1], 4, "cuda"), 0.2)
    table = torch.tensor([t + [0] * (4 - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    out = paged_decode_attention(q, cache_k, cache_v, table, torch.tensor([10, 3, 14], dtype=torch.int32, device="cuda"), 4, 0.2)
    assert torch.allclose(out.cpu(), reference, atol=1e-4)


@pytest.mark.parametrize("heads", [16, 128])  # DeepSeek-V2-Lite; DeepSeek-V3 (64 heads a program in bf16)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_decode_kernel_equals_the_reference(dtype, heads):
    from afd.kernels.decode_attention import paged_latent_decode_attention
    from tests.runtime.test_mla_cache import _expanded_reference, _latent_decode_case

    q, cache, tables, lens, block_size, latent = _latent_decode_case(heads=heads, latent=512, rope=64)
    want = _expanded_reference(q, cache, tables, lens, block_size, latent, 0.07)
    got = paged_latent_decode_attention(q.to("cuda", dtype), cache.to("cuda", dtype), latent, tables.cuda(), lens.cuda(),
                                        block_size, 0.07)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert float((got.float().cpu() - want).norm() / want.norm()) < tolerance


def monolithic(path, dtype, graphs=False, mixed_tokens=0, prompts=PROMPTS, max_tokens=GPU_TOKENS, kv_dtype=None):
    from afd.engine.generation import greedy_generate
    from afd.kv.cache import KVCache
    from afd.models.loader import load_model
    from afd.runners.monolithic_runner import MonolithicRunner

    loaded = load_model(str(path), dtype=dtype, device="cuda")
    kv_cache = KVCache(loaded.model.kv_layouts(), 64, kv_dtype or dtype, "cuda", block_size=16)
    runner = MonolithicRunner(loaded, kv_cache)
    if graphs:
        runner.capture_graphs(8, mixed_tokens)
    return greedy_generate(runner, kv_cache, prompts, max_tokens, ignore_eos=True, device="cuda"), runner


@pytest.mark.parametrize("name", ["deepseek_v2", "qwen3_moe"])
def test_fp32_on_gpu_equals_transformers(name, checkpoints, hf_reference):
    tokens, logits = hf_reference(name)
    result, _ = monolithic(checkpoints[name], torch.float32)
    assert [t[:NEW_TOKENS] for t in result.tokens] == tokens


def test_graph_replay_equals_eager_output(checkpoints):
    eager, _ = monolithic(checkpoints["deepseek_v2"], torch.bfloat16)
    graphed, runner = monolithic(checkpoints["deepseek_v2"], torch.bfloat16, graphs=True)
    assert runner.graphs.replays == GPU_TOKENS - 1
    assert graphed.tokens == eager.tokens
    assert max_relative_error(graphed.last_logits, eager.last_logits) < 2e-2


@pytest.mark.parametrize("name", ["deepseek_v2", "qwen3_moe"])
def test_piecewise_prompt_graphs_equal_eager_steps(name, checkpoints):
    """The prompt step replays piecewise graphs (CUDA capture, padded to a token bucket): same tokens, same logits."""
    eager, _ = monolithic(checkpoints[name], torch.bfloat16)
    graphed, runner = monolithic(checkpoints[name], torch.bfloat16, graphs=True, mixed_tokens=64)
    assert runner.mixed_graphs.replays == 1 and runner.graphs.replays == GPU_TOKENS - 1
    assert graphed.tokens == eager.tokens
    assert max_relative_error(graphed.last_logits, eager.last_logits) < 2e-2


def afd_nccl(path, topology, stages, graphs, gate="ffn", dbo_min_tokens=0, kv_cache_dtype="auto"):
    """Greedy tokens from real processes: FFN rank(s) on GPU 1, attention ranks on GPU 0 (or all on GPU 0:
    tests.gpu.nccl_env), NCCL data plane; with graphs the prompt step replays piecewise graphs."""
    from afd.config import AFDConfig, config_to_env
    from afd.local.group_processes import local_zmq_config
    from afd.local.children import LocalProcesses

    base = AFDConfig(
        num_attention_ranks=int(topology[0]), num_ffn_ranks=1, stages=stages, model=str(path), dtype="bfloat16",
        device="cuda", cuda_graphs=graphs, max_num_seqs=8, gate_on_attention=gate == "attention",
        ffn_batch_window_s=0.002 if topology == "2A1F" else 0.0, peer_timeout_s=60.0, dbo_min_tokens=dbo_min_tokens,
        kv_cache_dtype=kv_cache_dtype,
    )
    config = local_zmq_config(base).replace(connector="nccl")
    with LocalProcesses() as processes:
        processes.start("ffn-0", ["serve"], {**config_to_env(config.replace(role="ffn")), **gpu_env("ffn-0", 1)})
        tokens = attention_tokens(processes, config, ["ffn-0"], GPU_TOKENS)
        if graphs:  # the prompt step had piecewise graphs to replay (their equality is the tokens')
            assert all("captured piecewise prefill graphs" in processes.log_path(f"attn-{rank}").read_text()
                       for rank in range(config.group.num_attention_ranks))
    return tokens


@nccl_pairs
@pytest.mark.parametrize("topology, stages, graphs, gate", [
    ("1A1F", 1, False, "ffn"), ("1A1F", 2, False, "ffn"), ("1A1F", 1, True, "ffn"),
    ("1A1F", 2, True, "ffn"), ("2A1F", 2, True, "ffn"),
    ("1A1F", 1, False, "attention"), ("1A1F", 2, True, "attention"),
])
def test_bf16_afd_over_nccl_equals_bf16_monolithic(topology, stages, graphs, gate, checkpoints):
    reference, _ = monolithic(checkpoints["deepseek_v2"], torch.bfloat16, graphs=graphs)
    assert afd_nccl(checkpoints["deepseek_v2"], topology, stages, graphs, gate) == reference.tokens


@nccl_pairs
def test_steps_under_dbo_min_tokens_replay_one_micro_batch_graphs(checkpoints):
    """stages=2 with AFD_DBO_MIN_TOKENS above every batch: graphs whose second stage is empty, same tokens."""
    reference, _ = monolithic(checkpoints["deepseek_v2"], torch.bfloat16, graphs=True)
    assert afd_nccl(checkpoints["deepseek_v2"], "1A1F", 2, True, dbo_min_tokens=1000) == reference.tokens


def test_an_eager_mixed_step_never_waits_for_the_device_in_attention():
    """A step of decodes and a prompt chunk (no graph): building its metadata and attending never synchronize
    (a synchronization per layer serializes host launches with device work)."""
    from afd.models.paged_attention import AttentionBatch, cached_attention

    block, heads, latent = 16, 16, 576
    cache_k = torch.randn(64 * block, 1, latent, device="cuda", dtype=torch.bfloat16)
    tables = [list(range(8 * s, 8 * s + 8)) for s in range(5)]
    context, new = [100, 30, 0, 77, 12], [1, 1, 90, 1, 40]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = AttentionBatch.build(tables, context, new, block, "cuda")
        q = torch.randn(sum(new), heads, latent, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(sum(new), 1, latent, device="cuda", dtype=torch.bfloat16)
        out = cached_attention(q, k, None, cache_k, cache_k[:, :, :512], batch, latent**-0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (sum(new), heads, 512) and bool(torch.isfinite(out.float()).all())
    # the decode rows went through the paged kernel, the chunks through SDPA: both equal the CPU path in fp32
    cpu_cache = cache_k.float().cpu()
    cpu_batch = AttentionBatch.build(tables, context, new, block, "cpu")
    expected = cached_attention(q.float().cpu(), k.float().cpu(), None, cpu_cache, cpu_cache[:, :, :512], cpu_batch,
                                latent**-0.5)
    assert max_relative_error(out.float().cpu(), expected) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, kv_heads, key_dim, value_dim", [(8, 2, 128, 128), (16, 16, 192, 128)],
                         ids=["gqa-flash", "mla-expanded"])
def test_one_varlen_call_equals_one_sdpa_per_prompt(dtype, heads, kv_heads, key_dim, value_dim):
    """All prompts of a step (fresh ones and chunks over cached keys, decodes between them) in one variable-length
    kernel call attend exactly as each prompt alone under SDPA's lower-right causal bias."""
    from afd.models.paged_attention import AttentionBatch, prompt_attention, prompts_attention

    torch.manual_seed(0)
    block = 16
    context, new = [0, 40, 100, 0, 7, 300], [130, 1, 17, 2, 64, 1]
    tables = [list(range(32 * s, 32 * s + 32)) for s in range(len(new))]
    layout = AttentionBatch.build(tables, context, new, block, "cuda").prompts
    queries = sum(q1 - q0 for q0, q1, _, _ in layout.spans_host)
    q = torch.randn(queries, heads, key_dim, device="cuda", dtype=dtype)
    keys = torch.randn(layout.key_rows.shape[0], kv_heads, key_dim, device="cuda", dtype=dtype)
    values = torch.randn(layout.key_rows.shape[0], kv_heads, value_dim, device="cuda", dtype=dtype)
    got = prompts_attention(q, keys, values, layout, key_dim**-0.5)
    for q0, q1, k0, k1 in layout.spans_host:
        expected = prompt_attention(q[q0:q1], keys[k0:k1], values[k0:k1], key_dim**-0.5)
        assert max_relative_error(got[q0:q1].float(), expected.float()) < (2e-2 if dtype == torch.bfloat16 else 1e-4)
