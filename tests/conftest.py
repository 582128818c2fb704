"""Shared fixtures: tiny random checkpoints written by transformers, and HF reference outputs."""

from __future__ import annotations

import pytest

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11], [7], [40, 41, 42, 43]]
NEW_TOKENS = 16


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name → folder of a tiny checkpoint (two seeds of DeepSeek-V2, one variant, Qwen3-MoE, DeepSeek-V3, GLM-4.x
    with and without q/k norms, FP8 ones)."""
    from afd.checkpoint_tools.fp8_convert import dequantize_folder
    from afd.checkpoint_tools.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("checkpoints")
    folders = {
        "deepseek_v2": make_tiny_model("deepseek_v2", root / "deepseek_v2", seed=0),
        "qwen3_moe": make_tiny_model("qwen3_moe", root / "qwen3_moe", seed=0),
        "deepseek_v2_seed1": make_tiny_model("deepseek_v2", root / "deepseek_v2_seed1", seed=1),
        # DeepSeek-V2 (not Lite): low-rank queries and group-limited routing
        "deepseek_v2_full": make_tiny_model(
            "deepseek_v2",
            root / "deepseek_v2_full",
            seed=2,
            overrides={"q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
        ),
        # DeepSeek-V3: query LoRA, n_group 4 / topk_group 2, a dense first layer, YaRN, an MTP layer in the files
        "deepseek_v3": make_tiny_model("deepseek_v3", root / "deepseek_v3", seed=0),
        # GLM-4.x: rotary on half of each head, q/k norms, q/k/v biases, a dense first layer, noaux_tc groups, an MTP
        # layer in the files; and without q/k norms or biases, rotary on a quarter of each head
        "glm4_moe": make_tiny_model("glm4_moe", root / "glm4_moe", seed=0),
        "glm4_moe_plain": make_tiny_model("glm4_moe", root / "glm4_moe_plain", seed=6, overrides={
            "use_qk_norm": False, "attention_bias": False, "partial_rotary_factor": 0.25}),
        # FP8 block-quantized (the published FP8 format) and, for transformers on CPU, their dequantized copies
        "deepseek_v3_fp8": make_tiny_model("deepseek_v3", root / "deepseek_v3_fp8", seed=3, fp8=True),
        "qwen3_moe_fp8": make_tiny_model("qwen3_moe", root / "qwen3_moe_fp8", seed=4, fp8=True),
        "glm4_moe_fp8": make_tiny_model("glm4_moe", root / "glm4_moe_fp8", seed=7, fp8=True),
    }
    for name in ("deepseek_v3_fp8", "qwen3_moe_fp8", "glm4_moe_fp8"):
        folders[f"{name}_dequantized"] = dequantize_folder(folders[name], root / f"{name}_dequantized")
    return folders


@pytest.fixture(scope="session")
def hf_reference(checkpoints):
    """name → (tokens, last-step logits) of transformers' greedy `generate`, one prompt at a time; for an FP8
    checkpoint, of its dequantized copy (transformers does not run FP8 on CPU)."""
    cache = {}

    def reference(name):
        if name not in cache:
            cache[name] = transformers_greedy(checkpoints.get(f"{name}_dequantized", checkpoints[name]))
        return cache[name]

    return reference


def transformers_greedy(folder):
    """(tokens, last-step logits) of transformers' greedy `generate` of PROMPTS over the checkpoint `folder`, one
    prompt at a time, NEW_TOKENS each."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # like --ignore-eos: exactly NEW_TOKENS tokens
    tokens, logits = [], []
    for prompt in PROMPTS:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        tokens.append(out.sequences[0, len(prompt) :].tolist())
        logits.append(out.logits[-1][0].float())
    return tokens, logits


def max_relative_error(ours, theirs) -> float:
    import torch

    return max(
        float((torch.as_tensor(a) - b).abs().max() / b.abs().max()) for a, b in zip(ours, theirs)
    )
