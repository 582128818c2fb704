"""The pure check an FFN rank applies to an attention peer's Hello before it may join."""

from __future__ import annotations

from afd.connector.wire import Hello

_CHECKS = (
    ("token_digest", "group token differs (is the peer from another AFD deployment?)"),
    ("topology", "topology differs"),
    ("connector", "data plane differs (set the same AFD_CONNECTOR on both roles)"),
    ("model_fingerprint", "model fingerprint differs (are both roles loading the same checkpoint?)"),
    ("gate_on_attention", "gate placement differs"),
    ("layers", "crossing layer list differs"),
    ("hidden_size", "hidden size differs"),
    ("dtype", "dtype differs"),
    ("stages", "stage count differs"),
    ("router_width", "router logit width differs"),
)


def check_hello(hello: Hello, expected: Hello, served_ranks: tuple[int, ...]) -> str | None:
    """None when `hello` may join; otherwise the reason, naming both values."""
    for field, problem in _CHECKS:
        theirs, ours = getattr(hello, field), getattr(expected, field)
        if theirs != ours:
            if field == "token_digest":
                return problem
            return f"{problem}: attention has {_show(theirs)}, ffn has {_show(ours)}"
    if (hello.expert_parallel, hello.ffn_shard) != (expected.expert_parallel, expected.ffn_shard):
        return (f"mis-sharded peer: attention expects shard {hello.ffn_shard} of {hello.expert_parallel}, this ffn "
                f"process is shard {expected.ffn_shard} of {expected.expert_parallel} (check AFD_FFN_EXPERT_PARALLEL "
                "on both roles and the ffn pod's ordinal, rank·G + shard, or AFD_FFN_SHARD)")
    if hello.attention_rank not in served_ranks:
        return f"attention rank {hello.attention_rank} is not served by this ffn rank (it serves {list(served_ranks)})"
    return None


def _show(value) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)
