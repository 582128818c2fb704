"""Model families (DeepSeek-V2/V3, Kimi-K2, Qwen3-MoE, GLM-4.x) and their role split.

Kept import-light: `afd.models.spec` and `afd.models.checkpoint` are what callers
need first; `afd.models.loader.load_model` builds a role's model.
"""
