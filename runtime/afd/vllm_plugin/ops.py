"""The FFN exchange as a torch custom op, so vLLM's torch.compile treats it as one opaque call.

Custom ops cannot capture Python objects, so the op finds its link by an integer id
(the afd-plugin does the same for its NCCL communicators). The fake implementation only
gives the output's shape, so tracing never touches the network.
"""

from __future__ import annotations

import torch

from afd.vllm_plugin.link import StepLink

_LINKS: dict[int, StepLink] = {}


def register_link(link: StepLink) -> int:
    """Make `link` reachable from the op; returns its id."""
    link_id = len(_LINKS)
    _LINKS[link_id] = link
    return link_id


@torch.library.custom_op("afd_vllm::ffn_exchange", mutates_args=())
def ffn_exchange(hidden: torch.Tensor, router_logits: torch.Tensor | None, layer: int, link_id: int) -> torch.Tensor:
    """FFN output [tokens, hidden] of crossing layer `layer`, computed on the FFN rank."""
    return _LINKS[link_id].exchange(layer, hidden, router_logits)


@ffn_exchange.register_fake
def _ffn_exchange_shape(hidden, router_logits, layer, link_id):
    return torch.empty_like(hidden)
