"""Which checkpoint tensors the attention side reads: the same split as `afd.models.split`, by name.

The vLLM model reads its weights itself (through `afd.models.checkpoint.Checkpoint`), only
the keys this predicate keeps, so expert tensors are never read from disk on the attention
side. A test checks the predicate against our own attention loader. Torch-free.
"""

from __future__ import annotations

import re
from typing import Iterable

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GATE_KEYS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def attention_reads(key: str, crossing: frozenset[int] | set[int], gate_on_attention: bool) -> bool:
    """True when the attention side of a split with remote FFNs on `crossing` layers needs `key`."""
    match = _LAYER_KEY.match(key)
    if not match or int(match.group(1)) not in crossing:
        return True
    rest = match.group(2)
    if gate_on_attention:  # norm and router stay; experts (routed and shared) are remote
        return not rest.startswith("mlp.") or rest in _GATE_KEYS
    return not (rest.startswith("mlp.") or rest.startswith("post_attention_layernorm."))


def attention_keys(keys: Iterable[str], crossing: Iterable[int], gate_on_attention: bool) -> list[str]:
    """The subset of checkpoint `keys` the attention side reads, in order."""
    remote = frozenset(crossing)
    return [key for key in keys if attention_reads(key, remote, gate_on_attention)]
