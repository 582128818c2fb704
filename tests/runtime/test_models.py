"""Our single-device models equal transformers on the same checkpoint (the outside oracle)."""

import pytest
import torch

from afd.engine.generation import greedy_generate
from afd.kv.cache import KVCache
from afd.models.loader import load_model
from afd.runners.monolithic_runner import MonolithicRunner
from tests.conftest import NEW_TOKENS, PROMPTS, max_relative_error


def monolithic_generate(path):
    loaded = load_model(str(path))
    kv_cache = KVCache(loaded.model.kv_layouts(), 8 * len(PROMPTS), torch.float32, "cpu", block_size=4)
    return greedy_generate(MonolithicRunner(loaded, kv_cache), kv_cache, PROMPTS, NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("name", ["deepseek_v2", "qwen3_moe", "deepseek_v2_full", "glm4_moe", "glm4_moe_plain"])
def test_monolithic_equals_transformers(name, checkpoints, hf_reference):
    tokens, logits = hf_reference(name)
    result = monolithic_generate(checkpoints[name])
    assert result.tokens == tokens
    assert max_relative_error(result.last_logits, logits) < 1e-4


def test_batched_prefill_and_decode_equal_one_prompt_at_a_time(checkpoints):
    path = checkpoints["qwen3_moe"]
    together = monolithic_generate(path)
    loaded = load_model(str(path))
    kv_cache = KVCache(loaded.model.kv_layouts(), 8, torch.float32, "cpu", block_size=4)
    for index, prompt in enumerate(PROMPTS):
        alone = greedy_generate(MonolithicRunner(loaded, kv_cache), kv_cache, [prompt], NEW_TOKENS, ignore_eos=True)
        assert alone.tokens[0] == together.tokens[index]


def test_eos_stops_generation_unless_ignored(checkpoints):
    path = checkpoints["deepseek_v2"]
    loaded = load_model(str(path))
    kv_cache = KVCache(loaded.model.kv_layouts(), 8, torch.float32, "cpu", block_size=4)
    runner = MonolithicRunner(loaded, kv_cache)
    free_run = greedy_generate(runner, kv_cache, [PROMPTS[0]], NEW_TOKENS, ignore_eos=True).tokens[0]
    eos = free_run[3]  # pretend the 4th generated token is EOS
    stopped = greedy_generate(runner, kv_cache, [PROMPTS[0]], NEW_TOKENS, eos_token_ids=[eos]).tokens[0]
    assert stopped == free_run[: free_run.index(eos) + 1]
    assert kv_cache.free_blocks == 8  # blocks come back after generation


def test_deepseek_v3_monolith_equals_transformers(checkpoints, hf_reference):
    tokens, logits = hf_reference("deepseek_v3")
    result = monolithic_generate(checkpoints["deepseek_v3"])
    assert result.tokens == tokens
    assert max_relative_error(result.last_logits, logits) < 1e-4


def test_kimi_k2_is_served_as_deepseek_v3(checkpoints, tmp_path):
    """Kimi-K2's config.json says model_type kimi_k2 for the DeepSeek-V3 architecture."""
    import json
    import shutil

    shutil.copytree(checkpoints["deepseek_v3"], tmp_path / "kimi", dirs_exist_ok=True)
    config = json.loads((tmp_path / "kimi" / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(config))
    assert monolithic_generate(tmp_path / "kimi").tokens == monolithic_generate(checkpoints["deepseek_v3"]).tokens


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_mtp_layers_are_neither_read_nor_resident(name, checkpoints, caplog):
    import logging

    from afd.models.checkpoint import Checkpoint

    path = checkpoints[name]
    mtp = [key for key in Checkpoint(path).keys() if key.startswith("model.layers.3.")]
    assert any(key.endswith("eh_proj.weight") for key in mtp) and any(".mlp.experts." in key for key in mtp)
    with caplog.at_level(logging.INFO, logger="afd.models.loader"):
        loaded = load_model(str(path))
    assert not set(mtp) & set(loaded.loaded_keys)
    assert len(loaded.model.layers) == 3
    assert not any(name.startswith("model.layers.3.") for name in loaded.model.state_dict())
    assert [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()] == [
        f"checkpoint holds 1 next-token-prediction (MTP) layer (model.layers.3, {len(mtp)} tensors): not read, not resident"]


def test_deepseek_v3_without_a_query_lora_equals_transformers(tmp_path):
    """DeepSeek-V3's MLA with q_proj (q_lora_rank null), as well as the query LoRA of the shared fixture."""
    from afd.checkpoint_tools.tiny import make_tiny_model
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("deepseek_v3", tmp_path / "v3", seed=5, overrides={"q_lora_rank": None})
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    result = monolithic_generate(path)
    for prompt, tokens in zip(PROMPTS, result.tokens):
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)
        assert out[0, len(prompt):].tolist() == tokens
