"""The sample models' dims the benchmarks build at: DeepSeek-V2-Lite, Qwen3-30B-A3B, and their (and DeepSeek-V3's) MoE
layers."""

# DeepSeek-V2-Lite's config.json dims (https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite)
V2_LITE = dict(
    model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
    n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
    max_position_embeddings=163840, hidden_act="silu",
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
)


# Qwen3-30B-A3B's config.json dims (https://huggingface.co/Qwen/Qwen3-30B-A3B): GQA 32/4 heads of 128, 48 MoE layers
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
    rope_theta=1000000.0, max_position_embeddings=40960, hidden_act="silu", attention_bias=False,
    tie_word_embeddings=False,
)


# The MoE layers of the sample models, as the MoE benchmarks and the tuner take them (`--shape`); Qwen3-30B-A3B's
# config.json dims (https://huggingface.co/Qwen/Qwen3-30B-A3B): 128 experts, top-8, width 768, no shared experts.
MOE_SHAPES = {
    "deepseek-v2-lite": dict(routed=V2_LITE["n_routed_experts"], shared=V2_LITE["n_shared_experts"],
                             top_k=V2_LITE["num_experts_per_tok"], hidden=V2_LITE["hidden_size"],
                             inter=V2_LITE["moe_intermediate_size"], norm_topk_prob=False, fp32_logits=True),
    "qwen3-30b-a3b": dict(routed=128, shared=0, top_k=8, hidden=2048, inter=768, norm_topk_prob=True,
                          fp32_logits=False),  # as afd.models.qwen3_moe builds it: a bf16 router
    # DeepSeek-V3's (https://huggingface.co/deepseek-ai/DeepSeek-V3 config.json): 256 routed + 1 shared, top-8,
    # noaux_tc routing over 8 groups keeping 4, normalized, scaled by 2.5
    "deepseek-v3": dict(routed=256, shared=1, top_k=8, hidden=7168, inter=2048, norm_topk_prob=True,
                        fp32_logits=True, n_group=8, topk_group=4, routed_scaling_factor=2.5),
}


def v2_lite(layers: int) -> dict:
    """DeepSeek-V2-Lite's dims with `layers` decoder layers (the first dense)."""
    return {**V2_LITE, "num_hidden_layers": layers}
