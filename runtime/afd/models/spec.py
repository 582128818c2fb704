"""Torch-free facts about a checkpoint's architecture, read from its config.json."""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedModelError(ValueError):
    """A config.json this runtime cannot serve, with the reason."""


V3_ARCHES = ("deepseek_v3", "kimi_k2", "deepseek_v32")  # Kimi-K2 is the DeepSeek-V3 architecture; V3.2 adds DSA
MLA_ARCHES = ("deepseek_v2", *V3_ARCHES)
ARCHES = (*MLA_ARCHES, "qwen3_moe", "glm4_moe")


@dataclass(frozen=True)
class KVLayout:
    """What one layer caches per token: `heads` rows of `key_dim` keys and `value_dim` values.

    With `values_in_keys` the values are the first `value_dim` columns of each key row and
    are stored once (MLA's latent cache: one [latent ‖ rotary key] row per token serves as
    the key and, its latent part, as the value). `index_dim`: the width of one more row per
    token, a sparse-attention indexer's key (DeepSeek-V3.2), kept in a tensor of its own at
    the same cache rows.
    """

    heads: int
    key_dim: int
    value_dim: int
    values_in_keys: bool = False
    index_dim: int = 0

    @property
    def elements_per_token(self) -> int:
        return self.heads * (self.key_dim + (0 if self.values_in_keys else self.value_dim)) + self.index_dim


@dataclass(frozen=True)
class ModelSpec:
    """What both roles must agree on before any tensor moves."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    moe_layers: tuple[bool, ...]
    num_experts: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    kv_layout: KVLayout  # what every layer caches per token


def kv_layout(config: dict) -> KVLayout:
    """What each layer caches per token; MLA caches its latent and rotary key, not per-head K/V."""
    if config.get("model_type") in MLA_ARCHES:
        latent = config["kv_lora_rank"]
        index_dim = int(config.get("index_head_dim") or 128) if config.get("model_type") == "deepseek_v32" else 0
        return KVLayout(1, latent + config["qk_rope_head_dim"], latent, values_in_keys=True, index_dim=index_dim)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return KVLayout(config["num_key_value_heads"], head_dim, head_dim)


def moe_layer_mask(config: dict) -> tuple[bool, ...]:
    """Which decoder layers hold routed experts, by each family's own rule."""
    arch = config.get("model_type")
    layers = range(config["num_hidden_layers"])
    if arch == "deepseek_v32" and config.get("mlp_layer_types"):  # transformers writes both; the list wins
        kinds = config["mlp_layer_types"][: config["num_hidden_layers"]]
        return tuple(kind == "sparse" and bool(config.get("n_routed_experts")) for kind in kinds)
    if arch in MLA_ARCHES:
        experts = config.get("n_routed_experts") or 0
        first_dense = config.get("first_k_dense_replace", 3 if arch == "deepseek_v32" else 0)  # transformers' defaults
        every = config.get("moe_layer_freq", 1) or 1
        return tuple(bool(experts) and i >= first_dense and i % every == 0 for i in layers)
    if arch == "qwen3_moe":
        experts = num_experts(config)
        dense_only = set(config.get("mlp_only_layers") or [])
        step = config.get("decoder_sparse_step", 1) or 1
        return tuple(i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in layers)
    if arch == "glm4_moe":  # Glm4MoeConfig's default: one dense first layer
        first_dense = config.get("first_k_dense_replace", 1)
        return tuple(num_experts(config) > 0 and i >= first_dense for i in layers)
    raise UnsupportedModelError(f"model_type={arch!r} is not supported (supported: {', '.join(ARCHES)})")


def num_experts(config: dict) -> int:
    if config.get("model_type") in (*MLA_ARCHES, "glm4_moe"):
        return int(config.get("n_routed_experts") or 0)
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def rope_parameters(config: dict) -> dict:
    """RoPE settings in one shape, from the new `rope_parameters` or the older `rope_scaling` keys."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def parse_spec(config: dict) -> ModelSpec:
    """Validate the parts of config.json every role relies on."""
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={config['hidden_act']!r}: only silu MLPs are supported")
    if config.get("model_type") == "qwen3_moe" and config.get("use_sliding_window"):
        raise UnsupportedModelError("use_sliding_window=true: sliding-window attention is not supported")
    if config.get("model_type") == "deepseek_v2" and config.get("scoring_func", "softmax") != "softmax":
        raise UnsupportedModelError(f"scoring_func={config['scoring_func']!r}: only softmax routing is supported")
    if config.get("model_type") in V3_ARCHES:
        check_deepseek_v3(config)
    if config.get("model_type") == "deepseek_v32":
        check_deepseek_v32(config)
    if config.get("model_type") == "glm4_moe":
        check_expert_groups(config)
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    try:
        return ModelSpec(
            arch=config["model_type"],
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]),
            moe_layers=moe_layer_mask(config),
            num_experts=num_experts(config),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            kv_layout=kv_layout(config),
        )
    except KeyError as err:
        raise UnsupportedModelError(f"config.json lacks {err.args[0]!r}") from None


def check_deepseek_v3(config: dict) -> None:
    """The DeepSeek-V3 settings this runtime serves: noaux_tc sigmoid routing over equal expert groups,
    interleaved rotary dims; anything else is refused by name."""
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedModelError(f"scoring_func={config['scoring_func']!r}: DeepSeek-V3 routing supports sigmoid only")
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedModelError(f"topk_method={config['topk_method']!r}: DeepSeek-V3 routing supports noaux_tc only")
    if config.get("rope_interleave", True) is False:
        raise UnsupportedModelError("rope_interleave=false is not supported (DeepSeek-V3 checkpoints interleave)")
    check_expert_groups(config)


def check_deepseek_v32(config: dict) -> None:
    """DeepSeek-V3.2's sparse attention needs what its indexer is built from: a query LoRA (the indexer's queries
    are read from its latent) and index heads at least as wide as the rotary part they rotate."""
    if not config.get("q_lora_rank"):
        raise UnsupportedModelError("deepseek_v32 without q_lora_rank: the indexer's queries come from the query LoRA")
    if int(config.get("index_head_dim") or 128) < int(config["qk_rope_head_dim"]):
        raise UnsupportedModelError(f"index_head_dim={config.get('index_head_dim')} is narrower than "
                                    f"qk_rope_head_dim={config['qk_rope_head_dim']}, the part its rotary covers")
    if int(config.get("index_topk") or 2048) < 1:
        raise UnsupportedModelError(f"index_topk={config.get('index_topk')}: at least one token must be selected")


def check_expert_groups(config: dict) -> None:
    """noaux_tc's groups (DeepSeek-V3, GLM-4.x): `n_group` equal groups of the routed experts, of which the best
    `topk_group` hold at least `num_experts_per_tok` experts; anything else is refused by name."""
    experts, groups = int(config.get("n_routed_experts") or 0), int(config.get("n_group") or 1)
    topk_groups = int(config.get("topk_group") or 1)
    if experts and (experts % groups or not 1 <= topk_groups <= groups):
        raise UnsupportedModelError(f"n_group={groups}, topk_group={topk_groups} do not divide "
                                    f"n_routed_experts={experts} into groups to choose from")
    if experts and topk_groups * (experts // groups) < int(config.get("num_experts_per_tok") or 8):
        raise UnsupportedModelError(f"topk_group={topk_groups} groups of {experts // groups} experts hold fewer than "
                                    f"num_experts_per_tok={config.get('num_experts_per_tok')}")
