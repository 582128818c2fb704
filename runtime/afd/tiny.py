"""`afd make-tiny-model`: small random MoE checkpoints with a tokenizer, for demos and tests.

Weights come from `transformers` itself (its config classes and `save_pretrained`), so
the checkpoint is exactly what a Hugging Face user would produce. The tokenizer is a
byte-level BPE trained on a built-in paragraph, with a ChatML chat template.
"""

from __future__ import annotations

from pathlib import Path

ARCHES = ("deepseek_v2", "qwen3_moe")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = """Attention-FFN disaggregation splits a mixture-of-experts model in two. Attention ranks keep
the requests, the scheduler and the key-value cache; FFN ranks hold the experts and serve many
attention ranks at once, so every expert weight is read once for a large batch of tokens.
The quick brown fox jumps over the lazy dog. Hello, world! What is the capital of France? Paris.
Kubernetes runs the attention and FFN pods as StatefulSets; the operator reconciles the group.
0 1 2 3 4 5 6 7 8 9 10 100 1000. Tokens, layers, experts, routers, gates, norms and heads."""


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
        chat_template=CHAT_TEMPLATE,
    )


def _config(arch: str, vocab_size: int, eos_ids: list[int], overrides: dict):
    common = dict(
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
    if arch == "deepseek_v2":
        from transformers import DeepseekV2Config

        values = dict(
            common,
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
        )
        values.update(overrides)
        return DeepseekV2Config(**values)
    from transformers import Qwen3MoeConfig

    values = dict(
        common,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        max_position_embeddings=4096,
    )
    values.update(overrides)
    return Qwen3MoeConfig(**values)


def make_tiny_model(arch: str, out: str | Path, seed: int = 0, overrides: dict | None = None) -> Path:
    """Write a random `arch` checkpoint (float32) with tokenizer and chat template to `out`."""
    if arch not in ARCHES:
        raise ValueError(f"--arch {arch!r}: must be one of {', '.join(ARCHES)}")
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    tokenizer = _train_tokenizer(vocab_size=384)
    vocab_size = -(-len(tokenizer) // 64) * 64
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    config = _config(arch, vocab_size, eos_ids, overrides or {})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _make_world_readable(out)
    return out


def _make_world_readable(folder: Path) -> None:
    """0644 files in a 0755 folder: `save_pretrained` writes the weights through a private
    (0600) temporary file, which non-root role pods (uid 10001) could not read from a host path."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
