"""`afd make-tiny-model`: small random MoE checkpoints with a tokenizer, for demos and tests.

Weights come from `transformers` itself (its config classes and `save_pretrained`), so
the checkpoint is exactly what a Hugging Face user would produce. The tokenizer is a
byte-level BPE trained on a built-in paragraph, with a ChatML chat template that renders tools and tool calls
(in the architecture's markup).
"""

from __future__ import annotations

import copy
from pathlib import Path

FP8_ARCHES = ("deepseek_v3", "deepseek_v32", "qwen3_moe", "glm4_moe")  # --fp8: the published FP8 checkpoints' format
MTP_ARCHES = ("deepseek_v3", "deepseek_v32", "glm4_moe")  # their checkpoints carry MTP layers that transformers does not write
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, with the request's tools in a system turn, an assistant's calls in its family's markup (what its tool-call
# parser reads) and a tool result tagged with its call's id; without tools or calls it renders plain ChatML
_CALLS = {
    "deepseek": ("<｜tool▁calls▁begin｜>{% for call in message['tool_calls'] %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                 "{{ call['function']['name'] }}\n```json\n{{ call['function']['arguments'] }}\n```<｜tool▁call▁end｜>"
                 "{% endfor %}<｜tool▁calls▁end｜>"),
    "hermes": ("{% for call in message['tool_calls'] %}\n<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", "
               "\"arguments\": {{ call['function']['arguments'] }}}\n</tool_call>{% endfor %}"),
}


def chat_template(calls: str) -> str:
    """The tiny checkpoints' chat template, an assistant's calls written as `_CALLS[calls]`."""
    return (
        "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
        "<|im_end|>\n{% endif %}"
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['role'] == 'tool' and message['tool_call_id'] %}[{{ message['tool_call_id'] }}] {% endif %}"
        "{{ message['content'] if message['content'] is not none else '' }}"
        "{% if message['tool_calls'] %}" + _CALLS[calls] + "{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


CALL_MARKUP = {"deepseek_v2": "deepseek", "deepseek_v3": "deepseek", "deepseek_v32": "deepseek", "glm4_moe": "hermes", "qwen3_moe": "hermes"}
CHAT_TEMPLATE = chat_template("hermes")
_CORPUS = """Attention-FFN disaggregation splits a mixture-of-experts model in two. Attention ranks keep
the requests, the scheduler and the key-value cache; FFN ranks hold the experts and serve many
attention ranks at once, so every expert weight is read once for a large batch of tokens.
The quick brown fox jumps over the lazy dog. Hello, world! What is the capital of France? Paris.
Kubernetes runs the attention and FFN pods as StatefulSets; the operator reconciles the group.
0 1 2 3 4 5 6 7 8 9 10 100 1000. Tokens, layers, experts, routers, gates, norms and heads."""


def _train_tokenizer(vocab_size: int, template: str = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # local import: heavy: afd.cli imports this module
    from transformers import PreTrainedTokenizerFast  # local import: heavy: afd.cli imports this module

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=template,
    )


# per arch: what its toy config sets beyond `_common`'s values (`overrides` win over both)
ARCH_VALUES = {
    "deepseek_v2": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=2,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        max_position_embeddings=163840,
        # DeepSeek-V2-Lite's YaRN settings
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    ),
    # DeepSeek-V3's features at toy size: query LoRA, 4 expert groups of which 2 are searched, one dense first
    # layer, a shared expert, YaRN as V3 sets it, one MTP layer in the files (written by `_add_mtp_layers`); widths
    # over one 128-column FP8 block (hidden 160: a partial block) so the FP8 layout is exercised
    "deepseek_v3": dict(
        hidden_size=160,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        num_key_value_heads=4,
        n_routed_experts=16,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_mtp_layers=1,
        max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,  # DeepSeek-V3's
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0},
    ),
    # DeepSeek-V3.2: V3's toy with the indexer: 8 index heads of 32 dims (their first 8 rotated), index_topk 16
    # (prompts of a few dozen tokens already attend sparsely)
    "deepseek_v32": dict(
        hidden_size=160,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        num_key_value_heads=4,
        n_routed_experts=16,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=16,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_mtp_layers=1,
        max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0},
    ),
    # GLM-4.x's features at toy size: heads wider than hidden / heads with rotary on half of each, q/k norms and
    # q/k/v biases, one dense first layer, 4 expert groups of which 2 are searched, a shared expert, one MTP layer
    # in the files (written by `_add_mtp_layers`)
    "glm4_moe": dict(
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=32,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
        n_routed_experts=16,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_mtp_layers=1,
        max_position_embeddings=4096,
    ),
    "qwen3_moe": dict(
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        max_position_embeddings=4096,
    ),
}

ARCHES = tuple(ARCH_VALUES)


def _common(vocab_size: int, eos_ids: list[int]) -> dict:
    """What every arch's toy config sets (an arch's `ARCH_VALUES` may override it)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-6,
        initializer_range=0.08,  # wide enough that greedy choices are not near-ties
        eos_token_id=eos_ids,
        bos_token_id=None,
        pad_token_id=eos_ids[0],
        tie_word_embeddings=False,
    )


def _config(arch: str, vocab_size: int, eos_ids: list[int], overrides: dict):
    """`arch`'s transformers config: `_common`, then the arch's values, then `overrides`."""
    # local import: heavy: afd.cli imports this module
    from transformers import DeepseekV2Config, DeepseekV3Config, DeepseekV32Config, Glm4MoeConfig, Qwen3MoeConfig

    config_class = {"deepseek_v2": DeepseekV2Config, "deepseek_v3": DeepseekV3Config, "deepseek_v32": DeepseekV32Config,
                    "glm4_moe": Glm4MoeConfig, "qwen3_moe": Qwen3MoeConfig}
    # a copy: a config class may change the nested rope dicts in place
    return config_class[arch](**{**_common(vocab_size, eos_ids), **copy.deepcopy(ARCH_VALUES[arch]), **overrides})


def _randomize_router_biases(model) -> None:
    """transformers starts e_score_correction_bias at zero; a trained one is not, and it must change choices only."""
    import torch  # local import: heavy: afd.cli imports this module

    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn_like(buffer) * 0.1)


def _add_mtp_layers(folder: Path, config) -> None:
    """Append DeepSeek-V3's (or GLM-4.x's) next-token-prediction layers (`model.layers.{N..}`, N = num_hidden_layers) to the
    weights, as the published checkpoints carry them: a decoder layer plus enorm, hnorm, eh_proj and a shared
    head. transformers does not read them; neither do we."""
    import torch  # local import: heavy: afd.cli imports this module
    from safetensors.torch import load_file, save_file  # local import: heavy: afd.cli imports this module

    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    last = config.num_hidden_layers - 1
    prefix = f"model.layers.{last}."
    template = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    hidden, vocab = config.hidden_size, config.vocab_size
    template.update({"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
                     "eh_proj.weight": torch.empty(hidden, 2 * hidden),
                     "embed_tokens.weight": torch.empty(vocab, hidden), "shared_head.norm.weight": torch.ones(hidden),
                     "shared_head.head.weight": torch.empty(vocab, hidden)})
    for index in range(config.num_hidden_layers, config.num_hidden_layers + getattr(config, "num_mtp_layers", 0)):
        for name, like in template.items():
            tensors[f"model.layers.{index}.{name}"] = torch.randn(like.shape) * 0.08
    save_file(tensors, str(file), metadata={"format": "pt"})


def make_tiny_model(arch: str, out: str | Path, seed: int = 0, overrides: dict | None = None,
                    fp8: bool = False) -> Path:
    """Write a random `arch` checkpoint (float32) with tokenizer and chat template to `out`; with `fp8` its
    projection weights FP8 block-quantized as the published FP8 checkpoints (`afd.checkpoint_tools.fp8_convert`)."""
    if arch not in ARCHES:
        raise ValueError(f"--arch {arch!r}: must be one of {', '.join(ARCHES)}")
    if fp8 and arch not in FP8_ARCHES:
        raise ValueError(f"--fp8: FP8 checkpoints are made for {', '.join(FP8_ARCHES)}, not {arch!r}")
    import torch  # local import: heavy: afd.cli imports this module
    from transformers import AutoModelForCausalLM  # local import: heavy: afd.cli imports this module

    out = Path(out)
    tokenizer = _train_tokenizer(vocab_size=384, template=chat_template(CALL_MARKUP[arch]))
    vocab_size = -(-len(tokenizer) // 64) * 64
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    config = _config(arch, vocab_size, eos_ids, overrides or {})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        _randomize_router_biases(model)
    model.save_pretrained(out)
    if arch in MTP_ARCHES:
        _add_mtp_layers(out, config)
    if fp8:
        from afd.checkpoint_tools.fp8_convert import quantize_folder  # local import: torch: afd.cli imports this module

        quantize_folder(out)
    tokenizer.save_pretrained(out)
    _make_world_readable(out)
    return out


def _make_world_readable(folder: Path) -> None:
    """0644 files in a 0755 folder: `save_pretrained` writes the weights through a private
    (0600) temporary file, which non-root role pods (uid 10001) could not read from a host path."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
